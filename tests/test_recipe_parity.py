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


# ------------------------------------------------ Partial FC 0.3 (wf42m_vit_t_pfc03)

PFC = "wf42m_vit_t_pfc03"


NAMED = ["arcface_r50", "cosface_r100", PFC]


def _torch_table():
    """recipe_parity_torch.py's CASES, read without importing torch."""
    import ast
    from scripts import ROOT
    with open(f"{ROOT}/benchmarks/recipe_parity_torch.py") as f:
        tree = ast.parse(f.read())
    return next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", None) == "CASES")


@pytest.mark.parametrize("case", NAMED)
def test_named_case_is_the_shipped_config(parity, case):
    # a case named after a config trains that config's backbone, head and optimizer
    # (tests/test_recipes.py holds the config to arcface_torch's recipe), and the torch side's
    # table says the same
    import yaml
    from plsc.models import resolve_name
    from scripts import ROOT
    spec = parity.CASES[case]
    assert spec["config"] == f"configs/{case}.yaml"
    with open(f"{ROOT}/{spec['config']}") as f:
        cfg = yaml.safe_load(f)
    name = resolve_name(cfg["Model"]["name"])  # wf42m: ViT_T_DP005_Mask0, drop path set to 0
    assert name.split("_DP")[0] == resolve_name(spec["network"])
    loss, o = cfg["Loss"], cfg["Optimizer"]
    for key, value in spec["loss"].items():
        assert loss.get(key, 1.0 if key == "sample_ratio" else None) == value, key
    assert (spec["optimizer"], spec["lr"], spec["weight_decay"]) == \
        (o["name"], o["lr"], o["weight_decay"])
    if o["name"] == "sgd":
        assert o["momentum"] == 0.9  # what plsc_config sets
    else:
        assert o["betas"] == [0.9, 0.999]
    assert o["grad_clip"] == 5.0
    margin = {"arcface": (1.0, loss.get("m2"), 0.0), "cosface": (1.0, 0.0, loss.get("m3"))}
    assert _torch_table()[case] == (
        spec["network"], margin[loss["margin"]], o["name"], o["lr"], o["weight_decay"],
        spec["num_classes"], loss.get("sample_ratio", 1.0))


def test_torch_side_samples_as_the_cases_say(parity):
    table = _torch_table()
    assert set(table) == set(parity.CASES)
    assert all(row[6] == parity.CASES[name]["loss"].get("sample_ratio", 1.0)
               for name, row in table.items())


def _heads_draws(labels, num_classes, ratio, seed):
    """The centres a one-rank PartialFC head (the Trainer's, seed = Global.seed) uses at each
    forward on these labels."""
    import numpy as np
    import paddle
    from plsc.loss.margins import CosFace
    from plsc.nn.partial_fc import PartialFC
    head = PartialFC(16, num_classes, CosFace(64.0, 0.4), sample_ratio=ratio, seed=seed)
    out = []
    for lab in labels:
        head(paddle.randn([len(lab), 16]), paddle.to_tensor(lab))
        out.append(head.sampled_index.numpy())
        head.release_sampled_rows()
    return np.stack(out)


def test_torch_runs_get_the_heads_draw(parity):
    # what the torch side replays is what the Trainer's head draws, step by step; and it is a
    # draw PartialFC_V2 could make: int(0.3 * C) sorted distinct centres, every positive kept
    import numpy as np
    labels = np.random.default_rng(5).integers(0, 100, (4, 8))
    got = parity.sampled_centres(labels, 100, 0.3, 2048)
    assert np.array_equal(got, _heads_draws(labels, 100, 0.3, 2048))
    assert got.shape == (4, 30) and got.dtype == np.int64
    for row, lab in zip(got, labels):
        assert np.all(np.diff(row) > 0) and set(lab) <= set(row)
    assert not np.array_equal(got, parity.sampled_centres(labels, 100, 0.3, 2049))


def test_pfc_trainer_path_updates_the_replayed_rows_only(parity, tmp_path):
    # the plsc side of the case on files as the torch side writes them (2 steps of 2 images):
    # the Trainer draws the replayed centres, moves those centres and no other, and stops on
    # centres it did not draw
    import argparse
    import numpy as np
    from plsc import torchfile
    from plsc.models import build_model, plsc_to_insightface
    rng = np.random.default_rng(0)
    torchfile.save(plsc_to_insightface(build_model("vit_t", embedding_size=512)),
                   str(tmp_path / "init_backbone.pt"))
    init_head = rng.normal(0, 0.01, (100, 512)).astype(np.float32)
    np.save(tmp_path / "init_head.npy", init_head)
    np.save(tmp_path / "images.npy", rng.uniform(-1, 1, (2, 2, 3, 112, 112)).astype(np.float32))
    labels = np.array([[3, 77], [3, 50]])
    np.save(tmp_path / "labels.npy", labels)
    sampled = parity.sampled_centres(labels, 100, 0.3, 2048)
    np.save(tmp_path / "sampled.npy", sampled)
    args = argparse.Namespace(steps=2, batch=2, seed=2048, threads=1, overrides=[], ranks=1)
    losses, _, head, options, _ = parity.train_plsc(args, parity.CASES[PFC], str(tmp_path),
                                                    [1e-3, 2e-4])
    assert len(losses) == 2 and options["sample_ratio"] == 0.3 and options["lr_used_matches"]
    moved = np.flatnonzero(np.any(head != init_head, axis=1))
    assert set(moved) == set(sampled.ravel()) and len(moved) < 100
    sampled[0] = parity.sampled_centres(labels, 100, 0.3, 7)[0]
    np.save(tmp_path / "sampled.npy", sampled)
    with pytest.raises(RuntimeError, match="step 0: the Trainer drew other centres"):
        parity.train_plsc(args, parity.CASES[PFC], str(tmp_path), [1e-3, 2e-4])


def test_pfc_case_is_one_rank_only(parity):
    with pytest.raises(SystemExit) as e:
        parity.main(["--ranks", "2", "--case", PFC, "--torch-python", "x", "--arcface-torch", "y"])
    assert e.value.code == 2
