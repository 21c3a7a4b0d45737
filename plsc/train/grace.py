"""Whether a stop checkpoint fits the grace period: the time a cluster gives between its SIGTERM
and its SIGKILL (Kubernetes and Slurm 30 s by default, spot instances 30-120 s;
docs/faults.md). `Checkpoint.grace_seconds` (0: no limit) is that budget.

Each rank knows the bytes it writes in a save and how fast it wrote: first from a probe at the
run's start (a file of up to `PROBE_BYTES` written and fsync'd where checkpoints go), then from
every save it makes. A stop whose save would not end within the grace period (the slowest
rank's prediction plus the time since the signal) is not started: a save killed half-way only
delays the exit, and its leftovers are removed at the next start anyway."""
import os
import time

import numpy as np
import paddle

from .. import distributed as pd
from ..fileio import AtomicWriter
from .preemption import host_group

__all__ = ["PROBE_BYTES", "SaveClock"]

PROBE_BYTES = 64 << 20  # the most a start-up probe writes


def _human(n):
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


class SaveClock:
    """This rank's save rate and the grace period it must fit. `nbytes`: what this rank writes
    in a checkpoint (its owner keeps it current)."""

    def __init__(self, grace_seconds, nbytes=0):
        self.grace = float(grace_seconds)
        self.nbytes = int(nbytes)
        self.rate = None  # bytes per second of the last measurement
        self.source = None  # what it was measured on, for messages
        self.warned = False

    @property
    def enabled(self):
        return self.grace > 0

    def measured(self, nbytes, seconds, source):
        """A save (or the probe) of `nbytes` took `seconds`."""
        self.rate = nbytes / max(seconds, 1e-6)
        self.source = source

    def probe(self, folder):
        """Measure the write rate into `folder` with a file of up to `PROBE_BYTES` (this rank's
        own, removed after). A folder that cannot take it (a full disk) leaves the rate to the
        first save, which reports the failure itself."""
        n = min(self.nbytes, PROBE_BYTES)
        chunk = bytes(min(n, 8 << 20))
        start = time.monotonic()
        try:
            os.makedirs(folder, exist_ok=True)
            probe = AtomicWriter(os.path.join(folder, ".plsc.save-probe"))  # a leftover's name
            try:
                for lo in range(0, n, len(chunk)):
                    probe.write(chunk[:n - lo])
                probe.sync()
            finally:
                probe.abort()  # never renamed into place
        except OSError:
            return
        self.measured(n, time.monotonic() - start, f"a {_human(n)} probe write at start")

    def predicted(self):
        """Seconds a stop checkpoint takes on this rank (0 before any measurement)."""
        return 0.0 if self.rate is None else self.nbytes / self.rate

    def slowest(self, extra=0.0, world=1):
        """The largest `predicted() + extra` of all ranks (a collective of every rank)."""
        value = paddle.to_tensor(np.array([self.predicted() + extra], np.float32),
                                 place=paddle.CPUPlace())
        if world > 1:
            pd.all_reduce_(value, "max", host_group())
        return float(value.numpy()[0])

    def describe(self, seconds):
        """`about 41.3 s (1.20 GB at 29.1 MB/s, measured on ...)`."""
        if self.rate is None:
            return f"about {seconds:.1f} s ({_human(self.nbytes)}, rate not measured)"
        return (f"about {seconds:.1f} s ({_human(self.nbytes)} at {_human(self.rate)}/s, "
                f"measured on {self.source})")

    def warning(self, world=1):
        """The warning to log (once a run) when a stop checkpoint would not fit, else None; a
        collective of every rank."""
        if not self.enabled:
            return None
        seconds = self.slowest(world=world)
        if self.warned or seconds <= self.grace:
            return None
        self.warned = True
        return (f"a stop checkpoint would take {self.describe(seconds)}, more than "
                f"Checkpoint.grace_seconds={self.grace:g}: on a preemption this run will exit "
                "without saving and resume from its last periodic checkpoint; a shorter "
                "Checkpoint.interval repeats fewer steps, faster storage (a local disk) lets "
                "the stop save in time")

    def fits(self, since_signal, world=1):
        """(whether a stop checkpoint started now ends within the grace period on every rank,
        the slowest rank's seconds for it including `since_signal`); a collective."""
        if not self.enabled:
            return True, 0.0
        seconds = self.slowest(since_signal, world)
        return seconds <= self.grace, seconds
