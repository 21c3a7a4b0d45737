"""Training engine: trainer, evaluator, checkpoints, logging; IJB-B/IJB-C evaluation."""
from .checkpoint import CheckpointManager, find_checkpoint, load_head_rows, read_meta
from .cleaning import clean_subcenters
from .evaluator import VerificationEvaluator, extract_embeddings
from .ijb import evaluate_ijb, extract_ijb_features
from .trainer import Trainer

__all__ = ["Trainer", "clean_subcenters", "VerificationEvaluator", "extract_embeddings", "CheckpointManager",
           "find_checkpoint", "load_head_rows", "read_meta", "evaluate_ijb", "extract_ijb_features"]
