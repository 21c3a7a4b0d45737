"""The closing block a run writes to its log however it ends: how and at which step it ended,
its wall time, the last complete checkpoint, the best held-out accuracy, and the command that
exports that checkpoint."""
import datetime
import os
import shlex
import signal
import time

from ..checkpoint import CheckpointSaveError, find_checkpoint, read_meta
from ..checkpoint.layout import best_folder
from ..data import DataError
from .divergence import Diverged
from .preemption import Preempted, RankLost

__all__ = ["closing_block"]


def _how(error):
    """How a run that raised `error` (None: none) ended, in a few words."""
    if error is None:
        return "finished"
    if isinstance(error, Preempted):
        name = signal.Signals(error.signum).name
        unsaved = "; no stop checkpoint: past the grace period" if error.unsaved else ""
        return f"stopped by signal {error.signum} ({name}){unsaved}"
    for kind, words in ((Diverged, "diverged"), (CheckpointSaveError, "a checkpoint could not be "
                        "written"), (RankLost, "a rank stopped answering"),
                        (DataError, "a data error")):
        if isinstance(error, kind):
            return words
    return f"ended by {type(error).__name__}"


def _best(trainer):
    """`target accuracy at step N (its backbone: best_<target>)` of each target: the best
    of this process's evaluations after step 0 (`Trainer.best`, what `best_<target>/` keeps)."""
    if trainer.evaluator is None:
        return "no evaluation (Eval.targets is empty)"
    if not trainer.best:
        evaluated = any(step > 0 for step, _ in trainer.eval_history)
        return "no finite accuracy" if evaluated else "no evaluation after step 0"
    return ", ".join(f"{target} {acc:.4f} at step {step} (its backbone: "
                     f"{best_folder(trainer.output_dir, target)})"
                     for target, (acc, step) in trainer.best.items())


def closing_block(trainer, error=None):
    """The closing lines of `trainer`'s run, ended by `error` (None: it finished). The
    checkpoint named is the newest complete one under the output folder (`find_checkpoint`,
    as a resume with Global.checkpoint=auto would take), with its step from its meta.json."""
    wall = time.monotonic() - trainer.started
    lines = [f"run ended at step {trainer.step} of {trainer.total_steps} ({_how(error)}); "
             f"wall time {datetime.timedelta(seconds=int(wall))} ({wall:.1f} s)"]
    path = find_checkpoint("auto", trainer.output_dir)
    if path is None:
        lines.append(f"  last complete checkpoint: none under "
                     f"{os.path.join(trainer.output_dir, 'checkpoints')}")
    else:
        lines.append(f"  last complete checkpoint: {path} (step {read_meta(path)['step']})")
    lines.append(f"  best held-out accuracy: {_best(trainer)}")
    if path is not None:
        config = os.path.join(trainer.output_dir, "config.yaml")
        lines.append(f"  export it: python tools/export.py -c {shlex.quote(config)} "
                     f"-o Global.checkpoint={shlex.quote(path)}")
    return lines
