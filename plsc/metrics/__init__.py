"""Verification accuracy, ROC and TAR@FAR."""
from .verification import (kfold_accuracy, pair_distances, roc_curve, tar_at_far,
                           verification_report)

__all__ = ["pair_distances", "kfold_accuracy", "roc_curve", "tar_at_far", "verification_report"]
