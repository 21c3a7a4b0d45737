"""What uses a trained model: verification tables, IJB-B/IJB-C, extraction, export and
sub-centre cleaning of a training set."""
from .cleaning import clean_subcenters
from .ijb import evaluate_ijb, extract_ijb_features
from .tasks import evaluate, export, extract, trained_backbone

__all__ = ["clean_subcenters", "evaluate_ijb", "extract_ijb_features", "evaluate", "export",
           "extract", "trained_backbone"]
