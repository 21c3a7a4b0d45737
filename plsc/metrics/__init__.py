"""Verification accuracy, ROC and TAR@FAR; IJB-B/IJB-C template verification; the block
score scan (`scan`) and all-pairs TAR at very low FAR (`allpairs`)."""
from .verification import (FOLDS, kfold_accuracy, pair_distances, roc_curve, tar_at_far,
                           verification_report)
from .ijb import (FAR_TARGETS, ijb_report, ijb_roc, pair_scores, roc_auc, tar_at_far_nearest,
                  template_features)

from .allpairs import ALLPAIRS_FARS, allpairs_tar_at_far, pair_counts
from .plot import angle_histogram_image, roc_image, save_angle_histogram_png, save_roc_png

__all__ = ["save_roc_png", "roc_image", "angle_histogram_image", "save_angle_histogram_png", "pair_distances", "kfold_accuracy", "roc_curve", "tar_at_far",
           "verification_report", "FOLDS", "FAR_TARGETS", "template_features", "pair_scores", "ijb_roc",
           "tar_at_far_nearest", "roc_auc", "ijb_report", "ALLPAIRS_FARS", "allpairs_tar_at_far",
           "pair_counts"]
