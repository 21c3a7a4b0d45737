"""Verification accuracy, ROC and TAR@FAR."""
from .verification import (kfold_accuracy, pair_distances, roc_curve, tar_at_far,
                           verification_report)

from .plot import save_roc_png

__all__ = ["save_roc_png", "pair_distances", "kfold_accuracy", "roc_curve", "tar_at_far", "verification_report"]
