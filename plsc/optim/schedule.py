"""Learning-rate schedules as pure functions of the optimizer step, wrapped for Paddle.

`lr_at(step)` is the rate used by optimizer step `step` (0-based): a linear
warmup over `warmup_steps`, then polynomial, piecewise or cosine decay over the
remaining steps. Two warmup indexings (`WARMUP_INDEXING`): "plsc", step i gets
(i+1)/W of the rate; "arcface_torch", as insightface's `PolynomialLRWarmup`
stepped by `train_v2.py`: step i in 1..W gets i/W, and step 0 the full rate
(torch's scheduler leaves the optimizer's initial rate in place at its
construction, and `train_v2.py` steps it after each optimizer step). `StepLR` exposes it as a Paddle `LRScheduler`, so
Paddle optimizers use it and its state (the step) is saved with them.
"""
import math

from paddle.optimizer.lr import LRScheduler

__all__ = ["make_lr_fn", "StepLR", "WARMUP_INDEXING"]

WARMUP_INDEXING = ("plsc", "arcface_torch")


def make_lr_fn(name, base_lr, total_steps, warmup_steps=0, power=2.0, end_lr=0.0,
               boundaries=(), gamma=0.1, warmup_indexing="plsc"):
    """lr(step) for `name` in poly, piecewise (boundaries in steps) or cosine."""
    if name not in ("poly", "piecewise", "cosine"):
        raise ValueError(f"unknown LR schedule {name!r}; expected poly, piecewise or cosine")
    if warmup_indexing not in WARMUP_INDEXING:
        raise ValueError(f"unknown warmup indexing {warmup_indexing!r}; expected plsc or "
                         "arcface_torch")
    ahead = 1 if warmup_indexing == "plsc" else 0
    total_steps, warmup_steps = int(total_steps), int(warmup_steps)
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"need 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps})")
    boundaries = sorted(int(b) for b in boundaries)
    decay_steps = max(total_steps - warmup_steps, 1)

    def lr_at(step):
        if step < warmup_steps:
            if step == 0 and not ahead:
                return base_lr
            return base_lr * (step + ahead) / warmup_steps
        if name == "piecewise":
            return base_lr * gamma ** sum(step >= b for b in boundaries)
        t = min((step - warmup_steps) / decay_steps, 1.0)
        if name == "poly":
            return (base_lr - end_lr) * (1.0 - t) ** power + end_lr
        return end_lr + 0.5 * (base_lr - end_lr) * (1.0 + math.cos(math.pi * t))

    return lr_at


class StepLR(LRScheduler):
    """A Paddle LRScheduler over `lr_fn`; call `step()` once per optimizer step."""

    def __init__(self, lr_fn):
        self.lr_fn = lr_fn
        super().__init__(learning_rate=lr_fn(0), last_epoch=-1)

    def get_lr(self):
        return float(self.lr_fn(max(self.last_epoch, 0)))
