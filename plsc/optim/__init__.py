"""Optimizers and schedules; sparse row updates for the class-sharded head."""
from .rounding import round_to
from .sparse_rows import SparseAdamW, SparseMomentum, SparseRowOptimizer

__all__ = ["SparseRowOptimizer", "SparseMomentum", "SparseAdamW", "round_to"]
