"""Stopping a run cleanly when the cluster asks: SIGTERM or SIGINT to any rank.

A handler records the first signal; after every optimizer step the ranks all-reduce (MAX) a
one-element flag, so all of them learn of a signal that reached only one and stop after the
same step. The trainer then writes a checkpoint and raises `Preempted`; `tools/train.py` exits
with `PREEMPTED_EXIT_CODE`. Further signals while the checkpoint is written are only counted:
the save finishes, and a kill that does not wait for it leaves the previous checkpoint intact
(checkpoints are written to a temporary folder and renamed).
"""
import signal
import threading

import paddle

from .. import distributed as pd

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "StopSignals"]

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later", which a re-queued job does


class Preempted(Exception):
    """Training stopped at `step` because of signal `signum`; `checkpoint` holds the state."""

    def __init__(self, step, signum, checkpoint):
        self.step, self.signum, self.checkpoint = int(step), int(signum), checkpoint
        super().__init__(f"preempted: stopped at step {self.step} by signal {self.signum} "
                         f"({signal.Signals(self.signum).name}); checkpoint {checkpoint}; resume "
                         "with -o Global.checkpoint=latest (or Global.checkpoint: auto, the "
                         "shipped configs' setting, resumes by itself)")


class StopSignals:
    """Within `with StopSignals() as stop:`, SIGTERM and SIGINT are recorded instead of ending
    the process (only where handlers can be installed: the main thread)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = 0  # the first signal received, 0 for none
        self.repeats = 0  # signals received after the first
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        return False

    def _record(self, signum, frame):
        if self.signum:
            self.repeats += 1
        else:
            self.signum = int(signum)

    def agreed(self, group=None):
        """The signal any rank of `group` received so far (0: none), the same on every rank.
        One all-reduce of one value and one host read."""
        flag = paddle.to_tensor([float(self.signum)], dtype="float32")
        if pd.group_rank_size(group)[1] > 1:
            pd.all_reduce_(flag, "max", group)
        return int(flag.item())
