"""plsc: large-scale classification for PaddlePaddle.

The classifier is split by class across ranks (model parallel), the backbone
stays data-parallel, and the softmax cross entropy is computed with a few
small collectives instead of gathering logits.
"""

__version__ = "0.1.0"
