"""How many threads a process's CPU kernels use: one rule for runs and for a user's own loop.

Paddle runs its CPU kernels on one thread unless told otherwise, and importing Paddle writes
``OMP_NUM_THREADS=1`` into the environment when it is unset (so a launcher's ranks inherit 1).
The rule (`choose`): a run's ``Global.cpu_threads``; else the user's own ``OMP_NUM_THREADS``
(read from the environment the process started with, so Paddle's own 1 is not mistaken for it;
in a launched rank a 1 is the launcher's Paddle import and counts as unset, a larger value is
the user's); else the cores this process may use (affinity mask, capped by a cgroup CPU quota)
divided by the ranks on its node, at least 1.

`apply` sets Paddle's threads and those of plsc's own kernels (`plsc.cpu_kernels`); a run does
it at its start (`plsc.runtime.start`). `ensure` is called when plsc builds a model, a head or
a sparse-row optimizer: the first call applies the rule unless a run already did or the user
set Paddle's threads themselves (seen in the OpenMP runtime Paddle bundles: a thread count
other than the 1 Paddle starts with), and logs it at debug level. Importing this module does
not import Paddle.
"""
import ctypes
import logging
import math
import os

__all__ = ["usable_cores", "choose", "apply", "ensure", "paddle_threads", "NOTE"]

NOTE = None  # the line `apply` logged last ("CPU threads per rank: n (why)"), None before
_LAUNCH_KEYS = ("PADDLE_TRAINER_ID", "PADDLE_LOCAL_SIZE", "PADDLE_TRAINERS_NUM")
_log = logging.getLogger("plsc.threads")


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

    from . import cpu_kernels
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
        return int(ctypes.CDLL(lib, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL).omp_get_max_threads())
    except (OSError, AttributeError, ImportError):
        return None


def ensure():
    """Apply the rule once in a process that has not chosen its threads: no run set them
    (`apply`) and Paddle's threads are still its 1; else plsc's kernels take Paddle's count."""
    global NOTE
    if NOTE is not None:
        return
    current = paddle_threads()
    if current is not None and current != 1:  # the user's choice (OMP_NUM_THREADS or a call)
        from . import cpu_kernels
        cpu_kernels.set_threads(current)  # plsc's own kernels follow it
        NOTE = f"CPU threads per rank: {current} (Paddle's, set before plsc: kept)"
    else:
        apply()
    _log.debug(NOTE)
