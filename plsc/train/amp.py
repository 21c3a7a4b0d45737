"""Dynamic loss scaling for float16 training, agreed across ranks."""

__all__ = ["LossScaler", "build_loss_scaler"]


class LossScaler:
    """Multiply the loss by `scale`; after a step whose gradients are not all
    finite (on any rank) skip the update and multiply the scale by `backoff_factor`; after
    `growth_interval` good steps in a row multiply it by `growth_factor`. Disabled: scale 1,
    no checks. The defaults are torch's GradScaler's (AMP.incr_every_n_steps sets the
    interval); unlike torch's, the scale stops at `min_scale`."""

    growth_factor = 2.0
    backoff_factor = 0.5

    def __init__(self, enabled, init_scale=65536.0, growth_interval=2000, min_scale=1.0):
        self.enabled = bool(enabled)
        self.scale = float(init_scale) if self.enabled else 1.0
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.good_steps = 0
        self.skipped = 0

    def update(self, finite):
        """Record the outcome of a step; returns whether to apply it."""
        if not self.enabled:
            return True
        if not finite:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped += 1
            return False
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True

    def state_dict(self):
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def set_state_dict(self, state):
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state["skipped"])


def build_loss_scaler(amp):
    """The loss scaler of an `AMP` config section: enabled for float16 AMP only."""
    return LossScaler(amp["enable"] and amp["dtype"] == "float16", amp["init_loss_scaling"],
                      amp["incr_every_n_steps"])
