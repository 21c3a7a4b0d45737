"""The class-sharded classification head and its softmax cross entropy."""
from .parallel_softmax import parallel_softmax_cross_entropy
from .partial_fc import PartialFC
from .workspace import Workspace

__all__ = ["PartialFC", "Workspace", "parallel_softmax_cross_entropy"]
