"""The process group: initialisation, rank, world size and backend."""
import os

import paddle
import paddle.distributed as dist

from . import slurm

__all__ = ["init", "is_initialized", "get_rank", "get_world_size", "get_backend", "launched_world_size",
           "launched_rank", "barrier"]


def launched_world_size():
    """World size announced by `paddle.distributed.launch`/`spawn`, or by Slurm in a task of
    `srun` (`plsc.distributed.slurm`); 1 when not launched."""
    slurm.adopt()
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


def launched_rank():
    """This process's rank as announced by the launcher or Slurm (0 when not launched), known
    before the process group is formed."""
    slurm.adopt()
    return int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def _default_backend():
    place = paddle.get_device()
    return "nccl" if place.startswith("gpu") else "gloo"


def init(backend="auto"):
    """Initialise the collective environment once.

    `backend` is "auto" (NCCL where the current device is a GPU, gloo on CPU),
    "nccl" or "gloo". When the process was not launched with several ranks
    this is a no-op and the world has size 1. In a task of `srun` without Paddle's launcher
    the rank and world come from Slurm (`plsc.distributed.slurm`).
    """
    if backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"backend must be 'auto', 'nccl' or 'gloo', got {backend!r}")
    if launched_world_size() <= 1 or dist.is_initialized():
        return
    if backend == "auto":
        backend = _default_backend()
    os.environ["PADDLE_DISTRI_BACKEND"] = backend
    dist.init_parallel_env()


def is_initialized():
    return dist.is_initialized()


def get_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def get_backend():
    """'GLOO', 'NCCL', ... of the default group; None for a world of size 1."""
    return dist.get_backend() if dist.is_initialized() else None


def barrier():
    """Wait for every rank (no-op for a world of size 1)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
