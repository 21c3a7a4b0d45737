"""A run's CPU set-up for a user's own loop too (`plsc.process.cpu_setup`): the thread count by one rule
(`choose`), applied once when plsc first builds a model, a head or an optimizer, never against
the user; and malloc keeping freed blocks. Checked in fresh processes by reading the OpenMP
runtime Paddle's CPU kernels run on, and by counting the page faults of refilling a large
tensor."""
import os
import subprocess
import sys

import pytest

from plsc.process import cpu_setup as threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USABLE = threads.usable_cores()

# What Paddle's kernels run on: its bundled OpenMP runtime's thread count, read with ctypes.
READ = """
import ctypes, os, paddle
lib = ctypes.CDLL(os.path.join(os.path.dirname(paddle.__file__), "libs", "libiomp5.so"))
from plsc.kernels import cpu_kernels
print(lib.omp_get_max_threads(), cpu_kernels.threads())
"""
LOOP = {  # a user's own loop, each building one thing of plsc (no runtime call)
    "model": "from plsc.models import build_model\nbuild_model('IResNetTiny')\n",
    "head": "from plsc.nn import PartialFC\nPartialFC(8, 10)\n",
    "optimizer": "from plsc.optim import SparseMomentum\nSparseMomentum(0.1)\n",
}
RUN = "import plsc\nfrom plsc.process import runtime\nruntime.set_cpu_threads()\n"  # as runtime.start


def _threads(code, **env):
    """(Paddle's threads, plsc kernels' threads) after `code`, in a fresh process started with
    the environment `env` on top of this one's minus OMP_NUM_THREADS and the launcher's keys
    (this process imported Paddle, which wrote OMP_NUM_THREADS=1 into its environment)."""
    base = {k: v for k, v in os.environ.items()
            if k != "OMP_NUM_THREADS" and not k.startswith("PADDLE_")}
    out = subprocess.run([sys.executable, "-c", code + READ], env=dict(base, PYTHONPATH=ROOT, **env),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return tuple(int(v) for v in out.stdout.split()[-2:])


def test_the_rule():
    assert threads.choose(None, {}) == (USABLE, f"{USABLE} usable core(s) / 1 rank(s) on this node")
    assert threads.choose(None, {"OMP_NUM_THREADS": "1"}) == (1, "OMP_NUM_THREADS")  # the user's
    # in a launched rank a 1 is the launcher's Paddle import: unset
    launched = {"OMP_NUM_THREADS": "1", "PADDLE_TRAINER_ID": "0", "PADDLE_LOCAL_SIZE": "1"}
    assert threads.choose(None, launched)[0] == USABLE
    assert threads.choose(None, dict(launched, PADDLE_LOCAL_SIZE=str(USABLE)))[0] == 1
    assert threads.choose(None, {"PADDLE_LOCAL_SIZE": str(4 * USABLE)})[0] == 1  # at least 1
    assert threads.choose(None, {"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")
    assert threads.choose(None, dict(launched, OMP_NUM_THREADS="3"))[0] == 3
    assert threads.choose(5, {"OMP_NUM_THREADS": "3"}) == (5, "Global.cpu_threads")
    assert threads.choose(None, {"OMP_NUM_THREADS": "x"})[0] == USABLE


@pytest.mark.skipif(USABLE < 2, reason="one usable core: the rule's count is Paddle's default")
def test_a_users_loop_gets_a_runs_threads_and_keeps_its_own():
    run = _threads(RUN)
    assert run == (USABLE, USABLE)
    for what, code in LOOP.items():
        assert _threads(code) == run, what
        assert _threads(code, OMP_NUM_THREADS="1") == (1, 1), what  # the user's 1 is kept
    # paddle imported first (it writes OMP_NUM_THREADS=1): still the rule, not Paddle's 1
    assert _threads("import paddle\n" + LOOP["head"]) == run
    # the user set Paddle's threads before plsc: kept, and plsc's kernels follow them
    own = "from paddle.base import core\ncore.set_num_threads(3)\n"
    assert _threads(own + LOOP["model"]) == (3, 3)
    # a launched rank (the launcher's 1 inherited): the rule, per rank
    assert _threads(LOOP["optimizer"], OMP_NUM_THREADS="1", PADDLE_TRAINER_ID="0",
                    PADDLE_LOCAL_SIZE="1") == run


# Page faults of refilling a fresh 256 MiB tensor (the fewest of three): few when malloc keeps
# freed blocks, about one a page when it unmaps them (tests/test_cpu_kernels.py's oracle).
FAULTS = """
import resource, numpy as np, paddle
def fill():
    np.from_dlpack(paddle.empty([64 << 20])).fill(1)
fill()
counts = []
for _ in range(3):
    minor = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fill()
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - minor)
print(min(counts))
"""


def _faults(code, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("PLSC_MALLOC", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code + FAULTS], env=dict(base, PYTHONPATH=ROOT, **env),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


def _fewest_faults(code, bound, tries=3):
    """The fewest faults over up to `tries` fresh processes, stopping once one is below `bound`:
    now and then the kernel places a mapping where the heap would grow, and glibc then serves a
    256 MiB block by mmap whatever malloc's settings (seen once in a CI run of the suite: 65537
    faults in one process, 0 in the next twelve). A process that does not keep freed memory
    faults on every page in every try."""
    counts = []
    while len(counts) < tries and (not counts or min(counts) >= bound):
        counts.append(_faults(code))
    return min(counts)


def test_a_users_loop_keeps_freed_memory_as_a_run_does():
    pages = (256 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert _faults("import plsc\n") > pages // 2  # nothing built: malloc as it was
    for what, code in LOOP.items():
        assert _fewest_faults(code, pages // 10) < pages // 10, what
    assert _faults(LOOP["head"], PLSC_MALLOC="keep") > pages // 2  # the user's opt-out


# Freed heap blocks below a live one (so not the heap's top, which glibc trims itself): kept
# resident by `keep_freed_memory`, given back by `release_freed_memory`. Prints whether it ran
# and the MiB VmRSS fell.
RELEASE = """
import ctypes
from plsc.process import cpu_setup
cpu_setup.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
blocks = [libc.malloc(8 << 20) for _ in range(32)]
guard = libc.malloc(2 << 20)  # above the blocks: their free space is not the heap's top
for b in blocks:
    ctypes.memset(b, 1, 8 << 20)
for b in blocks:
    libc.free(b)
kept = rss()
print(cpu_setup.release_freed_memory(), kept - rss())
"""


def _release(**env):
    base = {k: v for k, v in os.environ.items() if k not in ("PLSC_MALLOC",)}
    out = subprocess.run([sys.executable, "-c", RELEASE], env=dict(base, PYTHONPATH=ROOT, **env),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ran, fell = out.stdout.split()[-2:]
    return ran == "True", float(fell)


def test_release_gives_back_the_free_pages_malloc_keeps():
    ran, fell = _release()
    assert ran and fell > 128  # of the 256 MiB freed (their pages; the chunk headers stay)
    ran, fell = _release(PLSC_MALLOC="keep")  # malloc left alone: nothing to release
    assert not ran
