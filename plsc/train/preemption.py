"""Stopping a run cleanly when the cluster asks (SIGTERM or SIGINT to any rank), and saying
so clearly when a rank dies.

A handler records the first signal; before every optimizer step (its batches loaded) the ranks
all-reduce (MAX) a two-element flag, so all of them learn of a signal that reached only one,
and of a rank that could not load its batch, and stop at the same step. The flag lives on the
host and goes over a gloo group (`host_group`; on GPUs one beside NCCL's), so the agreement
reads no device tensor: a step's only device read is the trainer's loss-and-finite read.
The two cannot be one collective: a signal after step k must stop every rank at step k with
step k's state, so it is agreed after step k ends and before step k+1's forward (which
changes state for good: the fused head update, BatchNorm's statistics, the sampler's step),
while step k's finite check must be read before step k's update.
On a signal the trainer writes a checkpoint and raises `Preempted`; `tools/train.py` exits
with `PREEMPTED_EXIT_CODE`.
On a data error the failing rank raises its `DataError` and the others `PeerDataError` (exit
status 65). A second signal ends the process at once; the checkpoint folder being written is
temporary and the previous checkpoint stays intact.

A rank that dies breaks the collectives of the others: gloo reports the reset connection at
once, a hung rank only at the collective library's timeout. `peer_failure` recognises those
errors so that the trainer can raise `RankLost`, which `tools/train.py` reports in one line and
exits with `RANK_LOST_EXIT_CODE`.

Before `StopSignals` starts, `plsc.process.startup`'s guard answers the signals (exit 75 at once: there
is nothing to save yet); `StopSignals` takes over from it.
"""
import os
import re
import signal
import threading
import time

import numpy as np
import paddle

from .. import distributed as pd
from ..data import WorkerDied
from ..data.tensors import to_tensor
from ..process import startup
from ..process.exits import PREEMPTED_EXIT_CODE, RANK_LOST_EXIT_CODE

__all__ = ["PREEMPTED_EXIT_CODE", "RANK_LOST_EXIT_CODE", "Preempted", "RankLost", "StopSignals",
           "host_group", "peer_failure"]

# What gloo and NCCL say when the other end of a collective is gone or silent.
_PEER_ERRORS = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|"
                          r"TIMEOUT self_rank|pair_rank|gloo.*Timed out waiting|"
                          r"NCCL communicator was aborted|Watchdog caught collective operation "
                          r"timeout")


class Preempted(Exception):
    """Training stopped at `step` because of signal `signum`; `checkpoint` holds the state
    (None: stopped before this process's first step, nothing to save). `unsaved`: why no stop
    checkpoint was written (it would not fit the grace period); `checkpoint` is then the last
    complete one (None: none yet) and `resume_step` its step, from which a resume repeats the
    steps up to `step`."""

    def __init__(self, step, signum, checkpoint, unsaved=None, resume_step=0):
        self.step, self.signum, self.checkpoint = int(step), int(signum), checkpoint
        self.unsaved = unsaved
        name = f"signal {self.signum} ({signal.Signals(self.signum).name})"
        resume = ("resume with -o Global.checkpoint=latest (or Global.checkpoint: auto, the "
                  "shipped configs' setting, resumes by itself)")
        if unsaved is not None:
            repeated = (f"step {self.step}" if resume_step + 1 == self.step
                        else f"steps {resume_step + 1}-{self.step}")
            start = (f"resumes from {checkpoint} (step {resume_step})" if checkpoint
                     else "has no checkpoint to resume from and starts at step 0")
            super().__init__(f"preempted: stopped at step {self.step} by {name}; no stop "
                             f"checkpoint written: {unsaved}; the next start {start} and repeats "
                             f"{repeated}; {resume}")
            return
        if checkpoint is None:
            super().__init__(startup.preempted_message(self.signum, "the first step"))
            return
        super().__init__(f"preempted: stopped at step {self.step} by {name}; checkpoint "
                         f"{checkpoint}; {resume}")


class RankLost(Exception):
    """A collective failed because another rank died or stopped answering (`step` None:
    during start-up, before the first step)."""

    def __init__(self, rank, step, peer, detail, checkpoint):
        self.rank, self.peer, self.checkpoint = rank, peer, checkpoint
        self.step = None if step is None else int(step)
        who = f"rank {peer}" if peer is not None else "another rank"
        when = "during start-up" if step is None else f"after step {self.step}"
        super().__init__(f"rank {rank}: {who} stopped answering {when} "
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
    """Within `with StopSignals() as stop:`, the first SIGTERM or SIGINT is recorded instead of
    ending the process (only where handlers can be installed: the main thread); `agree` tells
    every rank. A second signal ends the process at once with status 128 + signal, whatever the
    main thread is doing (even waiting inside a collective): a thread reads the signals from
    Python's wake-up pipe. Stop signals within `BURST_SECONDS` of the first count as that one
    (`plsc.process.startup.same_request`: a launcher's and a scheduler's signals of one stop), unless
    both are SIGINT. A loader worker's death during a stop is part of it (`claims`). It takes
    over from `plsc.process.startup`'s guard (a signal the guard kept is recorded) and at its end puts
    back what was there before the guard."""

    SIGNALS = startup.SIGNALS
    BURST_SECONDS = startup.BURST_SECONDS

    def __init__(self):
        self.signum = 0  # the first signal received, 0 for none
        self.repeats = 0  # SIGTERMs of the first one's burst
        self._first_time = None
        self._previous = {}
        self._pipe = None
        self._previous_fd = -1

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._pipe = (read, write)
            self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            threading.Thread(target=self._watch, args=(read,), daemon=True,
                             name="plsc-stop-signals").start()
            guarded = startup.hand_over()
            if guarded is not None:
                self._previous, self._previous_fd, kept = dict(guarded[0]), guarded[1], guarded[2]
                if kept:
                    self._record(kept, None)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._pipe[1])  # the watcher reads the end of the pipe and closes it
            self._pipe = None
        return False

    def _record(self, signum, frame):
        if not self.signum:
            self.signum = int(signum)

    def seconds_since_signal(self):
        """Seconds since this process received its first stop signal, as the watcher thread
        read it (0: none, or one kept from start-up)."""
        return 0.0 if self._first_time is None else time.monotonic() - self._first_time

    def claims(self, err, wait=BURST_SECONDS):
        """Whether `err`, raised while loading a batch, is part of a stop rather than a data
        error: a loader worker died (`WorkerDied`) while this process has a stop signal, or
        every dead worker was killed by a stop signal and one reaches this process within
        `wait` seconds (a scheduler signalling a job's processes one by one may reach a worker
        first). A worker killed by SIGKILL alone, or by SIGTERM with no stop here, is not."""
        if not isinstance(err, WorkerDied):
            return False
        if not self.signum and err.signals and set(err.signals) <= set(self.SIGNALS):
            deadline = time.monotonic() + wait
            while not self.signum and time.monotonic() < deadline:
                time.sleep(0.02)  # the handler runs in this thread, between sleeps
        return bool(self.signum)

    def _watch(self, fd):
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while True:
                data = pipe.read(64)
                if not data:
                    return
                for signum in data:
                    if signum in self.SIGNALS:
                        self._count(signum)

    def _count(self, signum):
        now = time.monotonic()
        if self._first_time is None:
            self._first_time, self._first_signum = now, signum
            return
        if startup.same_request(self._first_signum, signum, now - self._first_time):
            self.repeats += 1
            return
        startup.end_at_once(signum, " (a checkpoint being written is left unfinished and "
                                    "removed at the next start)")

    def agree(self, data_failed=False, group=None):
        """(the signal any rank of `group` received so far or 0, the highest rank whose data
        failed to load or -1), the same on every rank: one all-reduce of two values held on the
        host, over a host group (`host_group`), so that on a GPU it waits for no kernel."""
        rank, world = pd.group_rank_size(group)
        flag = to_tensor(np.array([self.signum, rank + 1 if data_failed else 0], np.float32),
                         place=paddle.CPUPlace())  # a host tensor: no device read
        if world > 1:
            pd.all_reduce_(flag, "max", host_group(group))
        signum, failed = flag.numpy().tolist()
        return int(signum), int(failed) - 1


_HOST_GROUPS = {}


def host_group(group=None):
    """The group to all-reduce host (CPU) tensors of `group`'s ranks over: `group` itself where
    its backend is gloo (the CPU), else (NCCL: GPUs) a gloo group of the same ranks, made at
    the first call (a collective: every rank of `group` calls it at the same point) and kept."""
    if (pd.group_rank_size(group)[1] == 1
            or paddle.distributed.get_backend(group).lower() == "gloo"):
        return group
    key = None if group is None else tuple(group.ranks)
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = pd.gloo_group(key)
    return _HOST_GROUPS[key]
