"""The repository's scripts (tools/, benchmarks/) imported as modules from their files, without
their folders on sys.path (where tools/checkpoint.py would shadow any module `checkpoint`)."""
import importlib.util
import os
import signal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(path, name=None):
    """The module of the script at `path` (relative to the repository, e.g. "tools/train.py",
    or absolute), run afresh; `name`: its module name (default: the file's)."""
    name = name or os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # A tool's first line blocks the stop signals until its guard (plsc.process.startup.hold);
    # loading it runs no tool, so this test process gets them back.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    return module
