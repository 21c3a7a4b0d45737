"""How a run starts: what must happen before Paddle loads (`blas_dispatch`, run by `import
plsc`) and the device and process group every run of a config begins with (`start`), with
the CPU set-up they make (BLAS code path, threads, malloc). Importing this module imports
neither Paddle nor `plsc.config` (YAML and the schema), so that `import plsc` and a tool's
first line, before `plsc.process.startup.hold`, stay light; the functions that need them
import them. The backbone and data set a config names are built by `plsc.parts`, progress bars
drawn by `plsc.process.progress`.

**BLAS dispatch.** Paddle's bundled MKL picks a generic code path on processors that are not
Intel's; with ``MKL_DEBUG_CPU_TYPE=5`` it takes its AVX2 kernels (measured on an AMD EPYC: a
head GEMM at 24 GFLOP/s without, 80 with). MKL reads the variable at its first matrix product,
so `blas_dispatch` runs at ``import plsc``, which does not import Paddle. Intel processors,
processors without AVX2, a variable the user set, and ``PLSC_MKL_DISPATCH=keep`` are left alone.

**Paddle's ccache line.** Paddle 3.3 warns at every import that no ``ccache`` is on PATH (a
compiler cache for building C++ extensions, which plsc never does); `hide_ccache_warning`, also
run by ``import plsc``, leaves out that one message from that one Paddle module.

**Threads and malloc** (`plsc.process.cpu_setup`, the same for runs and for a user's own loop): threads
by one rule (Global.cpu_threads, else the user's OMP_NUM_THREADS, else the usable cores divided
by the ranks on the node), and malloc keeping freed blocks on the CPU.
"""
import os
import platform
import sys
import warnings

from .cpu_setup import apply as set_cpu_threads, choose as cpu_threads  # noqa: F401
from .cpu_setup import keep_freed_memory, usable_cores  # noqa: F401 (this module's API)

__all__ = ["blas_dispatch", "BLAS_NOTE", "hide_ccache_warning", "cpu_description", "usable_cores",
           "cpu_threads", "kernel_threads", "set_cpu_threads", "keep_freed_memory",
           "select_device", "start"]

BLAS_NOTE = None  # what blas_dispatch did, for the run's first log lines


def hide_ccache_warning():
    """Ignore the UserWarning "No ccache found ..." of Paddle's `paddle.utils.cpp_extension`
    (that message from that module only: every other warning stays as it was)."""
    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning,
                            module=r"paddle\.utils\.cpp_extension")


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
    BLAS_NOTE = ("MKL_DEBUG_CPU_TYPE=5 set: MKL takes its AVX2 kernels on this AMD processor, "
                 "about 3x faster matrix products (PLSC_MKL_DISPATCH=keep keeps MKL's own choice)")
    if "paddle" in sys.modules:
        warnings.warn("plsc set MKL_DEBUG_CPU_TYPE=5 after Paddle was imported: it takes effect "
                      "only if no matrix product has run yet; import plsc first", stacklevel=3)
    return BLAS_NOTE


def kernel_threads():
    """Threads of plsc's own numpy CPU kernels (`plsc.kernels.cpu_kernels`, e.g. the head's):
    those `set_cpu_threads` gave Paddle, 1 before it is called (Paddle's own default)."""
    from ..kernels import cpu_kernels
    return cpu_kernels.threads()


def select_device(name, cpu_threads=None):
    """'auto' picks the GPU when Paddle has one, else the CPU. The threads of the CPU kernels
    follow `cpu_threads` (`cpu_threads`: Global.cpu_threads); on the CPU, malloc keeps freed
    memory for reuse (`keep_freed_memory`)."""
    import paddle
    from ..config import ConfigError
    has_gpu = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if name == "gpu" and not has_gpu:
        raise ConfigError("Global.device is gpu but this Paddle build sees no GPU")
    if name == "gpu" or (name == "auto" and has_gpu):
        paddle.set_device(f"gpu:{int(os.environ.get('FLAGS_selected_gpus', '0').split(',')[0])}")
    else:
        paddle.set_device("cpu")
        keep_freed_memory()
    set_cpu_threads(cpu_threads)
    return paddle.get_device()


def start(cfg):
    """The preamble of every run of a config: its device (Global.device, Global.cpu_threads)
    and the process group of the launched ranks (or of a Slurm step's tasks; one process:
    none). Returns the device. A stop
    signal that `startup`'s guard kept until the group was formed ends the process once the
    set-up returns (or fails)."""
    from .. import distributed
    from . import startup
    distributed.slurm.adopt()  # a task of srun: its ranks per node count for the threads
    device = select_device(cfg["Global"]["device"], cfg["Global"]["cpu_threads"])
    try:
        distributed.init()
    finally:
        startup.group_ready()
    return device
