"""The class-sharded classification head and its softmax cross entropy."""
from .parallel_softmax import parallel_softmax_cross_entropy
from .partial_fc import PartialFC

__all__ = ["PartialFC", "parallel_softmax_cross_entropy"]
