"""How plsc uses the CPU: the BLAS code path and the threads of each rank.

**BLAS dispatch.** Paddle's bundled MKL picks a generic code path on processors that are not
Intel's; with ``MKL_DEBUG_CPU_TYPE=5`` it takes its AVX2 kernels (measured on an AMD EPYC: a
head GEMM at 24 GFLOP/s without, 80 with). MKL reads the variable at its first matrix product,
so `blas_dispatch` runs at ``import plsc``, which does not import Paddle. Intel processors,
processors without AVX2, a variable the user set, and ``PLSC_MKL_DISPATCH=keep`` are left alone.

**Threads.** Paddle runs a process's CPU kernels on ``OMP_NUM_THREADS`` threads, and writes 1
into the environment of every process that imports it when the variable is unset (so that a
launcher's ranks inherit 1). A value of 1 therefore cannot be told from "unset" and counts as
unset: each rank then uses the cores it may run on (its affinity mask, and a cgroup CPU quota
where one is set) divided by the ranks on its node, at least 1. A larger value is the user's
and is kept; ``Global.cpu_threads`` overrides both.
"""
import math
import os
import platform
import sys
import warnings

__all__ = ["blas_dispatch", "BLAS_NOTE", "THREADS_NOTE", "cpu_description", "usable_cores", "cpu_threads",
           "set_cpu_threads"]

BLAS_NOTE = None  # what blas_dispatch did, for the run's first log lines
THREADS_NOTE = None  # what set_cpu_threads did, likewise


def _cpu_info():
    """{"vendor_id", "model name", "flags"} of the first processor in /proc/cpuinfo (Linux;
    empty elsewhere)."""
    info = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "model name", "flags") and key not in info:
                    info[key] = value.strip()
                if not line.strip() and info:  # the end of the first processor
                    break
    except OSError:
        pass
    return info


def _cpu_flags():
    info = _cpu_info()
    return info.get("vendor_id", ""), set(info.get("flags", "").split())


def cpu_description():
    """The processor's vendor and model and whether it has AVX2 / AVX-512, for logs."""
    info = _cpu_info()
    flags = set(info.get("flags", "").split())
    simd = [name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f")) if flag in flags]
    return " ".join([info.get("vendor_id", platform.processor() or "unknown"),
                     info.get("model name", "")] + (["(" + ", ".join(simd) + ")"] if simd else []))


def blas_dispatch(environ=os.environ, cpu=None):
    """Set ``MKL_DEBUG_CPU_TYPE=5`` on an AMD processor with AVX2 unless the user set it or
    ``PLSC_MKL_DISPATCH=keep``; returns (and keeps in `BLAS_NOTE`) a line saying what was done,
    or None. Warns when Paddle is imported already: then it helps only if no matrix product
    has run yet."""
    global BLAS_NOTE
    if environ.get("PLSC_MKL_DISPATCH", "").lower() == "keep" or "MKL_DEBUG_CPU_TYPE" in environ:
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    vendor, flags = _cpu_flags() if cpu is None else cpu
    if vendor != "AuthenticAMD" or "avx2" not in flags:
        return None
    environ["MKL_DEBUG_CPU_TYPE"] = "5"
    BLAS_NOTE = ("MKL_DEBUG_CPU_TYPE=5 set: MKL takes its AVX2 kernels on this AMD processor "
                 "(PLSC_MKL_DISPATCH=keep turns this off)")
    if "paddle" in sys.modules:
        warnings.warn("plsc set MKL_DEBUG_CPU_TYPE=5 after Paddle was imported: it takes effect "
                      "only if no matrix product has run yet; import plsc first", stacklevel=3)
    return BLAS_NOTE


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


def cpu_threads(requested=None, environ=os.environ):
    """(threads for this rank's CPU kernels, why): `requested` (Global.cpu_threads), else an
    OMP_NUM_THREADS above 1, else the usable cores divided by the ranks on this node."""
    if requested:
        return int(requested), "Global.cpu_threads"
    try:
        omp = int(environ.get("OMP_NUM_THREADS", "1"))
    except ValueError:
        omp = 1
    if omp > 1:
        return omp, "OMP_NUM_THREADS"
    local = max(1, int(environ.get("PADDLE_LOCAL_SIZE", "1") or 1))
    cores = usable_cores()
    return max(1, cores // local), f"{cores} usable core(s) / {local} rank(s) on this node"


def set_cpu_threads(requested=None):
    """Apply `cpu_threads` to Paddle's CPU kernels; returns (and keeps in `THREADS_NOTE`) a
    line for the log."""
    global THREADS_NOTE
    from paddle.base import core
    threads, why = cpu_threads(requested)
    core.set_num_threads(threads)
    THREADS_NOTE = f"CPU threads per rank: {threads} ({why})"
    return THREADS_NOTE
