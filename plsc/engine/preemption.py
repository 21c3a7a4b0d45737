"""Stopping a run cleanly when the cluster asks (SIGTERM or SIGINT to any rank), and saying
so clearly when a rank dies.

A handler records the first signal; after every optimizer step the ranks all-reduce (MAX) a
one-element flag, so all of them learn of a signal that reached only one and stop after the
same step. The trainer then writes a checkpoint and raises `Preempted`; `tools/train.py` exits
with `PREEMPTED_EXIT_CODE`. Further signals while the checkpoint is written are only counted:
the save finishes, and a kill that does not wait for it leaves the previous checkpoint intact
(checkpoints are written to a temporary folder and renamed).

A rank that dies breaks the collectives of the others: gloo reports the reset connection at
once, a hung rank only at the collective library's timeout. `peer_failure` recognises those
errors so that the trainer can raise `RankLost`, which `tools/train.py` reports in one line and
exits with `RANK_LOST_EXIT_CODE`.
"""
import re
import signal
import threading

import paddle

from .. import distributed as pd

__all__ = ["PREEMPTED_EXIT_CODE", "RANK_LOST_EXIT_CODE", "Preempted", "RankLost", "StopSignals",
           "peer_failure"]

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later", which a re-queued job does
RANK_LOST_EXIT_CODE = 69  # EX_UNAVAILABLE: a rank this one needs is gone

# What gloo and NCCL say when the other end of a collective is gone or silent.
_PEER_ERRORS = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|"
                          r"TIMEOUT self_rank|pair_rank|gloo.*Timed out waiting|"
                          r"NCCL communicator was aborted|Watchdog caught collective operation "
                          r"timeout")


class Preempted(Exception):
    """Training stopped at `step` because of signal `signum`; `checkpoint` holds the state."""

    def __init__(self, step, signum, checkpoint):
        self.step, self.signum, self.checkpoint = int(step), int(signum), checkpoint
        super().__init__(f"preempted: stopped at step {self.step} by signal {self.signum} "
                         f"({signal.Signals(self.signum).name}); checkpoint {checkpoint}; resume "
                         "with -o Global.checkpoint=latest (or Global.checkpoint: auto, the "
                         "shipped configs' setting, resumes by itself)")


class RankLost(Exception):
    """A collective failed because another rank died or stopped answering."""

    def __init__(self, rank, step, peer, detail, checkpoint):
        self.rank, self.step, self.peer, self.checkpoint = rank, int(step), peer, checkpoint
        who = f"rank {peer}" if peer is not None else "another rank"
        super().__init__(f"rank {rank}: {who} stopped answering after step {self.step} "
                         f"({detail}); exiting. Last complete checkpoint: {checkpoint or 'none'}")


def peer_failure(err, rank, world_size):
    """(peer rank or None, one-line detail) when `err` is a collective's report that another
    rank is gone or silent, else None."""
    text = str(err)
    if not _PEER_ERRORS.search(text):
        return None
    lines = [line.strip() for line in text.splitlines() if _PEER_ERRORS.search(line)]
    detail = re.sub(r"^\[[^\]]*\]\s*", "", lines[0])[:200]  # drop the source-file prefix
    pair = re.search(r"pair_rank\s*=\s*(\d+)", text)
    if pair:
        peer = int(pair.group(1))
    else:  # gloo's reset names an address, not a rank; with two ranks it is the other one
        peer = 1 - rank if world_size == 2 else None
    return peer, detail


class StopSignals:
    """Within `with StopSignals() as stop:`, SIGTERM and SIGINT are recorded instead of ending
    the process (only where handlers can be installed: the main thread). After the first,
    SIGTERMs are counted; a second SIGINT (Ctrl-C again) raises KeyboardInterrupt."""

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
        if not self.signum:
            self.signum = int(signum)
            return
        self.repeats += 1
        if signum == signal.SIGINT:  # Ctrl-C twice: the user means it (a save stays atomic)
            raise KeyboardInterrupt

    def agreed(self, group=None):
        """The signal any rank of `group` received so far (0: none), the same on every rank.
        One all-reduce of one value and one host read."""
        flag = paddle.to_tensor([float(self.signum)], dtype="float32")
        if pd.group_rank_size(group)[1] > 1:
            pd.all_reduce_(flag, "max", group)
        return int(flag.item())
