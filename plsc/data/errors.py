"""The exception types raised for bad data files: `DataError`, and `PeerDataError` on the ranks
that stop because another rank met one."""

import signal

__all__ = ["DataError", "PeerDataError", "WorkerDied"]


class DataError(ValueError):
    """A data file is malformed: the message names the file, the key or
    offset, and what was expected."""


class PeerDataError(DataError):
    """Another rank could not load its data; that rank's own error names the sample."""

    def __init__(self, rank, peer, when):
        self.rank, self.peer = rank, peer
        super().__init__(f"rank {rank}: rank {peer} stopped on a data error {when} (its log names "
                         "the file or record); exiting")


class WorkerDied(DataError):
    """A loader worker died. `signals`: the signal numbers that killed the dead workers, one
    each (empty unless every one of them was killed by a signal), so that a stop can tell a
    death that is part of it from a data error. The memory advice is given only for SIGKILL,
    what the kernel's out-of-memory killer sends."""

    def __init__(self, deaths, what="data loader worker", lower="Data.num_workers or Data.batch_size"):
        """`deaths`: (pid, exit code or None for "closed its result pipe") of each dead worker,
        a negative code being the signal that killed it; `what` the worker is; `lower`: the
        options whose lowering the memory advice suggests."""
        self.signals = tuple(-code for _, code in deaths if code is not None and code < 0)
        if len(self.signals) < len(deaths):
            self.signals = ()
        how = ", ".join(f"pid {pid} {_death(code)}" for pid, code in deaths)
        advice = (f"; if it ran out of memory, lower {lower}"
                  if any(code == -signal.SIGKILL for _, code in deaths) else "")
        super().__init__(f"a {what} died ({how}){advice}")


def _death(code):
    if code is None:
        return "closed its result pipe"
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
