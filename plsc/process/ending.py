"""How a tool's process ends: `end(status)`, the last call of every tool (`end(main())`).

A process that is not a rank of a job of several exits the usual way (`sys.exit`).

A rank of a job of several (a Paddle process group of two or more was formed) runs Python's
exit handlers (logging's flush, multiprocessing's clean-up, Paddle's own), flushes its output
and leaves with `os._exit`: Python's finalisation and the C++ static destructors of the
libraries are skipped. Paddle 3.3's store server, which rank 0 runs on a libuv thread, can abort
when a peer's connection closes while those destructors run; the abort reaches the process as
SIGSEGV, and a rank that had finished its run and written everything ended with status 139 under
srun, -11 under Paddle's launcher (seen in CI: 2 of 3 full runs; a core dump shows the store's
thread in `LibUVClient::readCallback` → `abort` while the main thread was in `exit`). Everything
a run writes is closed before the tool returns (files, checkpoints, the VisualDL writer, the
loader's workers), so nothing is lost by skipping them. Importing this module imports nothing but
the standard library's `atexit`, `os` and `sys`.
"""
import atexit
import os
import sys

__all__ = ["end", "is_rank_of_several"]


def is_rank_of_several():
    """True when this process joined a Paddle process group of two or more ranks."""
    dist = sys.modules.get("paddle.distributed")  # not imported: no group was formed
    return dist is not None and dist.is_initialized() and dist.get_world_size() > 1


def end(status):
    """Exit with `status` (an int, or None for 0), the way the module docstring says."""
    status = 0 if status is None else int(status)
    if not is_rank_of_several():
        sys.exit(status)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone: nothing more can be said
            pass
    os._exit(status)
