"""The learning-rate schedules against arcface_torch's PolynomialLRWarmup, transcribed here.

The oracle is written from the definition in insightface's
recognition/arcface_torch/lr_scheduler.py (its recursive `get_lr`, not the closed form) and
torch's LRScheduler protocol (the constructor steps once, so `last_epoch` is 0 while the
first optimizer step runs), stepped as recognition/arcface_torch/train_v2.py steps it: the
optimizer step with the group's current rate, then `lr_scheduler.step()`.
"""
import pytest

from plsc.config import SCHEMA, ConfigError, validate
from plsc.optim.schedule import WARMUP_INDEXING, make_lr_fn


class _PolynomialLRWarmupOracle:
    """One param group's rate, as torch's LRScheduler and PolynomialLRWarmup move it."""

    def __init__(self, lr, warmup_iters, total_iters, power=1.0):
        self.group_lr = lr  # the optimizer's param group "lr", set by SGD(lr=cfg.lr)
        self.base_lr = lr  # torch: base_lrs = [group["initial_lr"]]
        self.warmup, self.total, self.power = warmup_iters, total_iters, power
        self.last_epoch = -1
        self.step()  # torch's LRScheduler.__init__ -> _initial_step() -> step()

    def _get_lr(self):
        l, w, t = self.last_epoch, self.warmup, self.total
        if l == 0 or l > t:
            return self.group_lr
        if l <= w:
            return self.base_lr * l / w
        factor = ((1.0 - (l - w) / (t - w)) / (1.0 - (l - 1 - w) / (t - w))) ** self.power
        return self.group_lr * factor

    def step(self):
        self.last_epoch += 1
        self.group_lr = self._get_lr()


def _train_v2_rates(lr, num_image, total_batch, warmup_epoch, num_epoch, power=1.0):
    """The rate of each optimizer step of train_v2.py (gradient_acc 1)."""
    warmup_step = num_image // total_batch * warmup_epoch
    total_step = num_image // total_batch * num_epoch
    sched = _PolynomialLRWarmupOracle(lr, warmup_step, total_step, power)
    rates = []
    for _ in range(total_step):
        rates.append(sched.group_lr)  # opt.step() uses the group's rate
        sched.step()  # then lr_scheduler.step()
    return rates, warmup_step, total_step


@pytest.mark.parametrize("warmup_epoch,power", [(2, 1.0), (0, 1.0), (3, 2.0)])
def test_arcface_torch_indexing_matches_polynomial_lr_warmup(warmup_epoch, power):
    # 10 epochs of 37 steps (num_image // total_batch = 1200 // 32 = 37, a remainder dropped)
    rates, w, t = _train_v2_rates(0.1, 1200, 32, warmup_epoch, 10, power)
    lr_fn = make_lr_fn("poly", 0.1, t, w, power=power, warmup_indexing="arcface_torch")
    ours = [lr_fn(i) for i in range(t)]
    # The oracle multiplies t - w factors; float64 rounding stays far below 1e-12 relative.
    assert ours == pytest.approx(rates, rel=1e-12, abs=1e-15)
    assert ours[0] == 0.1  # torch leaves the initial rate for the first step
    if w:
        assert ours[1] == pytest.approx(0.1 / w, rel=1e-15)  # the warmup starts at 1/W


def test_plsc_indexing_runs_one_step_ahead_of_arcface_torch():
    """The default: step i of the warmup gets (i+1)/W; after it the two coincide."""
    rates, w, t = _train_v2_rates(0.1, 1200, 32, 2, 10)
    lr_fn = make_lr_fn("poly", 0.1, t, w, power=1.0)
    assert [lr_fn(i) for i in range(w)] == pytest.approx([0.1 * (i + 1) / w for i in range(w)])
    assert [lr_fn(i) for i in range(1, w)] == pytest.approx(rates[2:w + 1])
    assert [lr_fn(i) for i in range(w, t)] == pytest.approx(rates[w:], rel=1e-12, abs=1e-15)


def test_warmup_indexing_is_validated():
    assert SCHEMA["LRScheduler"]["warmup_indexing"].choices == WARMUP_INDEXING
    with pytest.raises(ConfigError, match="warmup_indexing"):
        validate({"LRScheduler": {"warmup_indexing": "torch"}})
    with pytest.raises(ValueError, match="warmup indexing"):
        make_lr_fn("poly", 0.1, 10, 2, warmup_indexing="torch")
