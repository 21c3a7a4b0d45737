"""tools/train.py with injected faults, for tests/test_checkpoint_faults.py.

    python tests/fault_worker.py -c CONFIG [-o ...]

Environment:
    FAULT_ENOSPC=RANK:TEXT   on rank RANK, every write to a file whose path contains TEXT fails
                             with ENOSPC (as a full disk does)
    FAULT_NO_PRECHECK=1      skip the free-space check before a save (so that a small disk
                             fails in the middle of writing instead)
"""
import errno
import os
import sys

import plsc.checkpoint.manager as checkpoint
import plsc.fileio as fileio
from plsc.process import ending
import scripts


class _FullDisk:
    """A file whose writes fail as on a full disk."""

    def __init__(self, file):
        self._f = file

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)


if os.environ.get("FAULT_ENOSPC"):
    rank, text = os.environ["FAULT_ENOSPC"].split(":", 1)
    real_init = fileio.AtomicWriter.__init__

    def init(self, path):
        real_init(self, path)
        if int(os.environ.get("PADDLE_TRAINER_ID", "0")) == int(rank) and text in self.path:
            self._file = _FullDisk(self._file)

    fileio.AtomicWriter.__init__ = init
if os.environ.get("FAULT_NO_PRECHECK"):
    checkpoint._fits = lambda need, free: True

ending.end(scripts.load("tools/train.py").main(sys.argv[1:]))
