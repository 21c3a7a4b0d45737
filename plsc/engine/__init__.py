"""Training engine: trainer, evaluator, checkpoints, logging."""
from .checkpoint import CheckpointManager, find_checkpoint, load_head_rows, read_meta
from .evaluator import VerificationEvaluator, extract_embeddings
from .trainer import Trainer

__all__ = ["Trainer", "VerificationEvaluator", "extract_embeddings", "CheckpointManager",
           "find_checkpoint", "load_head_rows", "read_meta"]
