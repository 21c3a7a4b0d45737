"""How the trainer stops before its last step: a signal (`Preempted`), a data error on some
rank, a rank that stops answering (`RankLost`), too many non-finite steps in a row
(`Diverged`); each logged, then raised on every rank."""
import contextlib
import functools

from .. import distributed as pd
from ..process import startup
from ..checkpoint import find_checkpoint, read_meta
from ..data import PeerDataError
from .divergence import Diverged
from .preemption import Preempted, RankLost, peer_failure

__all__ = ["Stopping", "reports_lost_ranks"]


def reports_lost_ranks(init):
    """`Trainer.__init__` (start-up: process group, checkpoint agreement, every collective
    before the first step) with a rank that stops answering reported as in training:
    `RankLost`, one line, exit status 69."""
    @functools.wraps(init)
    def start(self, *args, **kwargs):
        with self._rank_failures(starting=True):
            init(self, *args, **kwargs)
    return start


class Stopping:
    """`Trainer`'s early stops: a mixin, on the trainer's log, step and checkpoints."""

    def _data_stop(self, error, failed):
        """Some rank could not load its batch: every rank stops at this step (65)."""
        self.log.close()  # the tool prints the one line (the error names the sample)
        raise error if error is not None else PeerDataError(self.rank, failed, f"after step {self.step}")

    @contextlib.contextmanager
    def _rank_failures(self, starting=False):
        """Turn a collective's error about a dead or silent rank into `RankLost` (`starting`:
        before the first step, where `__init__` may not have set the rank or the log yet)."""
        try:
            yield
        except RuntimeError as err:
            rank = getattr(self, "rank", pd.launched_rank())
            found = peer_failure(err, rank, getattr(self, "world", pd.launched_world_size()))
            if found is None:
                raise
            if starting:
                startup.settle()  # the launcher's SIGTERM to the survivors must not make it 75
            lost = RankLost(rank, None if starting else self.step, found[0], found[1],
                            find_checkpoint("auto", self.cfg["Global"]["output_dir"]))
            if getattr(self, "log", None) is not None:
                self.log.close()
            raise lost from None

    def _nonfinite_step(self, loss):
        """The step just taken was skipped for a non-finite loss or gradient: warn, and stop
        the run (`Diverged`) past Global.max_nonfinite_steps such steps in a row."""
        n, limit = self.nonfinite.run, self.nonfinite.limit
        what = "float16 loss scale at its floor" if self.scaler.enabled else "not finite"
        self.log.info(f"step {self.step}: loss {loss:.6g}, loss or gradients {what}: update "
                         f"skipped ({n} in a row, Global.max_nonfinite_steps={limit})")
        if self.nonfinite.exceeded:
            self._diverged(f"the loss or gradients were not finite in {n} consecutive steps "
                           f"(the last at step {self.step}, loss {loss:.6g}); their updates were "
                           "skipped")

    def _diverged(self, what):
        err = Diverged(what, find_checkpoint("auto", self.output_dir), self.cfg["Optimizer"]["lr"])
        self.log.info(str(err))
        self.log.close()
        raise err

    def _stop(self, signum, since_signal=0.0):
        """A rank was asked to stop (`since_signal` seconds ago on this rank): checkpoint this
        step (unless just done, or unless this process took no step: its state is the one it
        started from) and raise `Preempted`. A checkpoint that would not end within
        Checkpoint.grace_seconds of the signal on some rank is not started: every rank exits
        at once, naming the checkpoint the next start resumes from."""
        if not self.history:
            err = Preempted(self.step, signum, None)
        elif self._saved_step == self.step:
            err = Preempted(self.step, signum, self._saved_path)
        else:
            fits, seconds = self.save_clock.fits(since_signal, self.world)
            if fits:
                err = Preempted(self.step, signum, self.save())
            else:
                err = self._unsaved_stop(signum, seconds)
        self.log.info(str(err))
        self.log.close()
        raise err

    def _unsaved_stop(self, signum, seconds):
        """The `Preempted` of a stop whose checkpoint would end `seconds` after the signal,
        past the grace period."""
        clock = self.save_clock
        last = find_checkpoint("auto", self.output_dir)
        why = (f"it would end {seconds:.1f} s after the signal (a save takes "
               f"{clock.describe(clock.predicted())}), past Checkpoint.grace_seconds="
               f"{clock.grace:g}")
        return Preempted(self.step, signum, last, unsaved=why,
                         resume_step=read_meta(last)["step"] if last else 0)
