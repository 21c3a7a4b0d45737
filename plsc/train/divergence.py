"""A run whose loss or gradients stop being finite: steps skipped, then a clear stop.

A step whose loss or gradients are not finite on any rank is skipped on every rank (backbone
and head untouched, optimizer state included; the step still consumes its batch and its
learning rate, as a float16 loss-scale skip does). `NonFiniteSteps` counts such steps in a
row; past `Global.max_nonfinite_steps` the trainer raises `Diverged`, which `tools/train.py`
reports in one line and exits with `DIVERGED_EXIT_CODE`. No checkpoint is written from
weights that are not finite.
"""

from ..process.exits import DIVERGED_EXIT_CODE

__all__ = ["DIVERGED_EXIT_CODE", "Diverged", "NonFiniteSteps"]


class Diverged(Exception):
    """Training stopped because it diverged; `checkpoint` is the newest (finite) checkpoint
    or None."""

    def __init__(self, what, checkpoint, lr):
        self.checkpoint = checkpoint
        if checkpoint:
            advice = (f"the last finite checkpoint is {checkpoint}: resume from it with a lower "
                      f"learning rate, -o Global.checkpoint={checkpoint} -o Optimizer.lr=<below "
                      f"{lr:g}>")
        else:
            advice = f"no checkpoint was written; start again with an Optimizer.lr below {lr:g}"
        super().__init__(f"training diverged: {what}; {advice} (a longer warm-up, "
                         "LRScheduler.warmup_epochs, or Optimizer.grad_clip may help too)")


class NonFiniteSteps:
    """Consecutive skipped steps (`run`); `exceeded` past `limit` of them."""

    def __init__(self, limit):
        self.limit = int(limit)
        self.run = 0

    def record(self, applied, counts=True):
        """After a step: an applied step ends the run of skipped ones; a skipped one that
        `counts` extends it."""
        if applied:
            self.run = 0
        elif counts:
            self.run += 1

    @property
    def exceeded(self):
        return self.run > self.limit

    def state_dict(self):
        return {"run": self.run}

    def set_state_dict(self, state):
        self.run = int(state.get("run", 0))
