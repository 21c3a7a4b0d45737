"""Process group, collectives with CPU fallbacks, and the class partition."""
from .collective import (all_gather, all_reduce_, broadcast_, failed_rank, gather_concat,
                         group_rank_size, reduce_scatter, reduce_scatter_sum, start_sum, sync_buffers,
                         WIRE_DTYPES)
from .env import (barrier, get_backend, get_rank, get_world_size, gloo_group, init, is_initialized,
                  launched_rank, launched_world_size)
from .partition import ClassPartition
from . import slurm

__all__ = [
    "init", "barrier", "is_initialized", "get_rank", "get_world_size", "get_backend", "launched_world_size",
    "launched_rank", "gloo_group",
    "all_gather", "reduce_scatter", "gather_concat", "reduce_scatter_sum", "all_reduce_",
    "broadcast_", "sync_buffers", "group_rank_size", "failed_rank", "start_sum", "WIRE_DTYPES",
    "ClassPartition", "slurm",
]
