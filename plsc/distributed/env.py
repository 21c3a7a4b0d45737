"""The process group: initialisation, rank, world size and backend; extra gloo groups."""
import itertools
import os
import socket

import paddle
import paddle.distributed as dist

from . import slurm

__all__ = ["init", "is_initialized", "get_rank", "get_world_size", "get_backend", "launched_world_size",
           "launched_rank", "barrier", "gloo_group"]


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


_GLOO_GROUPS = itertools.count()  # every rank makes its gloo groups in the same order


def gloo_group(ranks=None):
    """A new gloo group of `ranks` (all by default) with connections of its own; a collective:
    every rank calls it at the same point (also those not in `ranks`).

    Paddle 3.3's gloo group rendezvouses on keys named by the bare ranks ("0", "1", ...) in the
    job's store, so a second gloo group made over that store can read the first group's
    addresses before its peers replace them and fail ("connection refused", an address of the
    wrong size, a timeout; seen on 4 ranks here). This group rendezvouses through a store of
    its own, served by its first rank on a free port that the job's store announces."""
    from paddle.base import core
    from paddle.distributed import collective
    world = get_world_size()
    ranks = sorted(range(world) if ranks is None else ranks)
    key = f"plsc/gloo_group/{next(_GLOO_GROUPS)}"
    rank, job_store = get_rank(), collective._default_store
    store = None
    if rank == ranks[0]:
        host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:0").rsplit(":", 1)[0]
        with socket.socket() as s:  # a port free now; the store binds it at once
            s.bind(("", 0))
            port = s.getsockname()[1]
        job_store.set(key, f"{host}:{port}".encode())
    elif rank in ranks:
        job_store.wait(key)
        host, port = bytes(job_store.get(key)).decode().rsplit(":", 1)
    if rank in ranks:
        store = core.TCPStore(host, int(port), rank == ranks[0], len(ranks))
    collective._set_default_store(store or job_store)  # what Paddle's new_group reads
    try:
        return dist.new_group(ranks, backend="gloo")
    finally:
        collective._set_default_store(job_store)
