"""How plsc sets up the CPU, for a run and for a user's own loop alike: threads and malloc.

**Threads.** Paddle runs its CPU kernels on one thread unless told otherwise, and importing
Paddle writes ``OMP_NUM_THREADS=1`` into the environment when it is unset (so a launcher's ranks
inherit 1). The rule (`choose`): a run's ``Global.cpu_threads``; else the user's own
``OMP_NUM_THREADS`` (read from the environment the process started with, so Paddle's own 1 is
not mistaken for it; in a launched rank a 1 is the launcher's Paddle import and counts as
unset, a larger value is the user's); else the cores this process may use (affinity mask,
capped by a cgroup CPU quota) divided by the ranks on its node, at least 1. `apply` gives that
count to Paddle and to plsc's own kernels (`plsc.kernels.cpu_kernels`).

**Malloc.** `keep_freed_memory` lets glibc keep freed blocks up to 1 GiB for reuse instead of
unmapping them (``PLSC_MALLOC=keep`` leaves malloc alone). Kept blocks stay resident even where
the steps that follow never reuse them: the first steps of a run place their tensors
differently from the later ones (and an evaluation or a checkpoint differently again), and
leave holes in the heap that only they touched. `release_freed_memory` gives those pages back
(glibc's ``malloc_trim``); the trainer calls it after its first `SETTLING_STEPS` steps, before
and after each evaluation and after each checkpoint, so the memory a rank keeps is what its
steps reuse and an evaluation's batches do not add to the step's freed blocks
(docs/performance.md, "Where a rank's memory goes"); the sparse-row optimizer calls it once a
step before it merges stashed micro-batches' rows (Partial FC with gradient accumulation),
whose large arrays do not fit the micro-batches' freed blocks.

A run does both at its start (`plsc.process.runtime.start`). `ensure` is called when plsc builds a
model, a head or a sparse-row optimizer: the first call in a process that has not chosen does
the same, logged at debug level, unless a run already did; the user's own thread count wins
(OMP_NUM_THREADS, or Paddle's count set before plsc: seen in the OpenMP runtime Paddle bundles
as a count other than the 1 it starts with), and malloc is set only when Paddle's device is
the CPU. Importing this module does not import Paddle.
"""
import ctypes
import logging
import math
import os

__all__ = ["usable_cores", "choose", "apply", "keep_freed_memory", "release_freed_memory",
           "keeps_freed_memory", "ensure", "paddle_threads", "NOTE", "MALLOC_NOTE",
           "SETTLING_STEPS"]

NOTE = None  # the line `apply` logged last ("CPU threads per rank: n (why)"), None before
MALLOC_NOTE = None  # what `keep_freed_memory` did, likewise
_KEEP_BYTES = 1 << 30  # freed blocks up to this size stay in the heap (mallopt's int limit: 2 GiB)
_kept = False  # whether `keep_freed_memory` set malloc's thresholds in this process
# Steps after which a run gives malloc's free pages back: in the IResNet18 run of
# docs/performance.md the pages a step touches stop growing from the third step on.
SETTLING_STEPS = 3
_LAUNCH_KEYS = ("PADDLE_TRAINER_ID", "PADDLE_LOCAL_SIZE", "PADDLE_TRAINERS_NUM")
_log = logging.getLogger("plsc.process.cpu_setup")


def _cgroup_cores():
    """CPUs allowed by a cgroup (v2 cpu.max or v1 cfs quota), or None when there is no quota."""
    for quota_file, period_file in (("/sys/fs/cgroup/cpu.max", None),
                                    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us",
                                     "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            with open(quota_file) as f:
                fields = f.read().split()
            if period_file is None:
                quota, period = fields[0], fields[1]
            else:
                with open(period_file) as f:
                    quota, period = fields[0], f.read().split()[0]
        except (OSError, IndexError):
            continue
        if quota in ("max", "-1"):
            return None
        return max(1, math.floor(int(quota) / int(period)))
    return None


def usable_cores():
    """Cores this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cores()
    return min(cores, quota) if quota else cores


def _start_environ():
    """The environment this process started with (Linux: /proc/self/environ, which Python's
    and Paddle's later changes do not touch); elsewhere the current one."""
    try:
        with open("/proc/self/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return dict(os.environ)
    pairs = (item.decode(errors="replace").partition("=") for item in items if b"=" in item)
    return {key: value for key, _, value in pairs}


def choose(requested=None, environ=None):
    """(threads, why) by the rule above. `environ`: the environment to read (None: the user's
    OMP_NUM_THREADS from the one the process started with, the launcher's keys from the
    current one, where `paddle.distributed.spawn` sets them)."""
    if requested:
        return int(requested), "Global.cpu_threads"
    start = _start_environ() if environ is None else environ
    environ = os.environ if environ is None else environ
    launched = any(environ.get(key) for key in _LAUNCH_KEYS)
    try:
        omp = int(start.get("OMP_NUM_THREADS", "0"))
    except ValueError:
        omp = 0
    if omp > 1 or (omp == 1 and not launched):
        return omp, "OMP_NUM_THREADS"
    local = max(1, int(environ.get("PADDLE_LOCAL_SIZE", "1") or 1))
    cores = usable_cores()
    return max(1, cores // local), f"{cores} usable core(s) / {local} rank(s) on this node"


def apply(requested=None):
    """Give Paddle's CPU kernels and plsc's own the threads `choose` picks; returns (and keeps
    in `NOTE`) a line for the log."""
    global NOTE
    from paddle.base import core

    from ..kernels import cpu_kernels
    threads, why = choose(requested)
    core.set_num_threads(threads)
    cpu_kernels.set_threads(threads)
    NOTE = f"CPU threads per rank: {threads} ({why})"
    return NOTE


def paddle_threads():
    """The thread count of the OpenMP runtime Paddle's CPU kernels run on (its bundled
    libiomp5, once Paddle is imported), or None when it cannot be read."""
    try:
        import paddle
        lib = os.path.join(os.path.dirname(paddle.__file__), "libs", "libiomp5.so")
        # RTLD_NOLOAD: a handle only if Paddle loaded it; local scope, so that no other
        # library (e.g. faiss, with its own OpenMP) resolves to it afterwards
        return int(ctypes.CDLL(lib, mode=os.RTLD_NOLOAD).omp_get_max_threads())
    except (OSError, AttributeError, ImportError):
        return None


def keep_freed_memory(environ=os.environ):
    """Let glibc's malloc keep freed memory instead of unmapping it (tensors above 32 MiB are
    otherwise mmapped and unmapped one by one, so every op writing a large output first takes a
    page fault per 4 KiB). Sets M_MMAP_THRESHOLD and M_TRIM_THRESHOLD to 1 GiB with mallopt;
    `PLSC_MALLOC=keep` leaves malloc as it is. Returns (and keeps in `MALLOC_NOTE`) a line for
    the log, None off glibc."""
    global MALLOC_NOTE, _kept
    if environ.get("PLSC_MALLOC", "").lower() == "keep":
        MALLOC_NOTE = "malloc: left as it is (PLSC_MALLOC=keep)"
        return MALLOC_NOTE
    try:
        libc = ctypes.CDLL("libc.so.6")
        mmap_threshold, trim_threshold = -3, -1  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
        ok = (libc.mallopt(mmap_threshold, ctypes.c_int(_KEEP_BYTES)) == 1
              and libc.mallopt(trim_threshold, ctypes.c_int(_KEEP_BYTES)) == 1)
    except (OSError, AttributeError):
        return None
    _kept = _kept or ok
    MALLOC_NOTE = ("malloc: freed blocks up to 1 GiB kept for reuse, not returned to the system "
                   "(PLSC_MALLOC=keep keeps glibc's own behaviour)" if ok
                   else "malloc: glibc refused mallopt; left as it is")
    return MALLOC_NOTE


def keeps_freed_memory():
    """Whether `keep_freed_memory` set malloc's thresholds in this process."""
    return _kept


def release_freed_memory():
    """Give the free pages malloc keeps back to the system (glibc's ``malloc_trim(0)``: the free
    top of each heap is returned and whole free pages inside it are dropped; blocks in use stay
    where they are). Only in a process whose malloc `keep_freed_memory` set (otherwise glibc
    trims on its own); returns whether it ran. A page given back and reused later costs a page
    fault then, so a run calls this only when the pages a step touches may have changed (its
    first steps, after an evaluation or a checkpoint), not every step."""
    if not _kept:
        return False
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        return False
    return True


def ensure():
    """A run's CPU set-up, once, in a process that has not made it: the thread rule unless a
    run applied it or Paddle's threads are no longer its 1 (then plsc's kernels take Paddle's
    count); malloc kept as a run keeps it when Paddle's device is the CPU."""
    global NOTE
    if NOTE is None:
        current = paddle_threads()
        if current is not None and current != 1:  # the user's (OMP_NUM_THREADS or a call)
            from ..kernels import cpu_kernels
            cpu_kernels.set_threads(current)  # plsc's own kernels follow it
            NOTE = f"CPU threads per rank: {current} (Paddle's, set before plsc: kept)"
        else:
            apply()
        _log.debug(NOTE)
    if MALLOC_NOTE is None:
        import paddle
        if paddle.get_device().startswith("cpu"):
            _log.debug(keep_freed_memory())
