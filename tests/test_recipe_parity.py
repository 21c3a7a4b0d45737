"""benchmarks/recipe_parity.py without torch: it does not run, and the learning rates it sets
into plsc are arcface_torch's PolynomialLRWarmup's (its definition written out by hand here)."""
import json

import pytest

from scripts import load


@pytest.fixture(scope="module")
def parity():
    return load("benchmarks/recipe_parity.py")


def test_without_torch_it_says_not_run(parity, capsys):
    assert parity.main([]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "not run"


def test_rates_are_polynomial_lr_warmup(parity):
    # lr_scheduler.py, stepped once after each optimizer step (train_v2.py): epoch 0 returns the
    # optimizer's rate unchanged (the base), epochs 1..w give base*e/w, later ones the previous
    # rate times ((1-(e-w)/(t-w)) / (1-(e-1-w)/(t-w)))^power, i.e. base*(1-(e-w)/(t-w))^power,
    # and past total_iters the rate stays.
    base, w, t = 0.1, 5, 20
    want = [base] + [base * e / w for e in range(1, w + 1)] + \
        [base * (1 - (e - w) / (t - w)) for e in range(w + 1, t + 1)]
    got = parity.polynomial_lr_warmup(base, w, t, t + 3)
    assert got[:t + 1] == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert got[:3] == [0.1, 0.02, 0.04]  # the full rate first, then the warm-up from 1/w
    assert got[t + 1:] == [got[t]] * 2  # e > total_iters: unchanged (0 here)
    squared = parity.polynomial_lr_warmup(base, w, t, 8, power=2.0)
    assert squared[7] == pytest.approx(base * (1 - 2 / 15) ** 2, rel=1e-12)


def test_ranks_need_an_even_split(parity):
    # --ranks 2: rank r trains on samples [r*B/2, (r+1)*B/2) of every batch of B
    with pytest.raises(SystemExit) as e:
        parity.main(["--ranks", "2", "--batch", "7", "--torch-python", "x",
                     "--arcface-torch", "y"])
    assert e.value.code == 2
