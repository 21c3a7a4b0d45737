"""tools/clean_subcenters.py: a short K = 3 training on synthetic identities with 10 % of the
labels deliberately wrong, then the cleaning tool (1 process and 2 launched ranks), checked
against the known mislabeled set and against an independent numpy computation; the K = 1
checkpoint it writes resumes with tools/train.py."""
import json
import os
import subprocess
import sys

import cv2
import numpy as np
import paddle
import pytest

import scripts
from plsc.config import dump_config, validate
from plsc.data.synthetic import make_prototype, make_template, render_sample
from plsc.train import Trainer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOOL = os.path.join(ROOT, "tools", "clean_subcenters.py")
CLASSES, PER_CLASS, IMAGE, NOISE, STEPS, K = 30, 40, 16, 0.10, 80, 3


def make_noisy_list(root, seed=0):
    """A list dataset of CLASSES synthetic identities (each its own random layout, mild
    nuisance) with NOISE of the samples relabeled to a random other class. Returns the list
    file, the true labels and the mislabeled mask."""
    rng = np.random.default_rng(seed)
    protos = [make_prototype(rng, IMAGE, make_template(rng, IMAGE)) for _ in range(CLASSES)]
    true = np.repeat(np.arange(CLASSES), PER_CLASS)
    labels = true.copy()
    bad = rng.choice(len(true), int(round(NOISE * len(true))), replace=False)
    labels[bad] = (true[bad] + rng.integers(1, CLASSES, len(bad))) % CLASSES
    os.makedirs(os.path.join(root, "img"))
    lines = []
    for i, c in enumerate(true):
        name = f"img/{i:05d}.png"
        img = render_sample(protos[c], rng, 0.3)
        cv2.imwrite(os.path.join(root, name), cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
        lines.append(f"{name} {labels[i]}\n")
    path = os.path.join(root, "train.lst")
    with open(path, "w") as f:
        f.writelines(lines)
    mislabeled = np.zeros(len(true), bool)
    mislabeled[bad] = True
    return path, labels, mislabeled


def run_config(data_list, out, **sections):
    raw = {
        "Global": {"seed": 0, "output_dir": out, "device": "cpu", "max_steps": STEPS,
                   "log_interval": 20},
        "Model": {"name": "IResNetTiny", "embedding_size": 128},
        "Loss": {"margin": "arcface", "scale": 32.0, "num_classes": CLASSES, "sub_centers": K},
        "Data": {"dataset": "list", "root": data_list, "image_size": [IMAGE, IMAGE],
                 "batch_size": 32, "num_workers": 0},
        "Optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "grad_clip": 5.0},
        "LRScheduler": {"warmup_steps": 2},
        "Eval": {"batch_size": 100},
        "Checkpoint": {"interval": 1000, "keep_last": 2},
        "Logging": {"visualdl": False, "progress_bar": False},
    }
    for sec, values in sections.items():
        raw.setdefault(sec, {}).update(values)
    return validate(raw)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("clean_subcenters")
    data_list, labels, mislabeled = make_noisy_list(str(base / "data"))
    out = str(base / "run")
    cfg = run_config(data_list, out)
    trainer = Trainer(cfg)
    trainer.train()
    yaml_path = str(base / "config.yaml")
    with open(yaml_path, "w") as f:
        f.write(dump_config(cfg))
    ckpt = os.path.join(out, "checkpoints", f"step_{STEPS:08d}")
    return {"base": base, "list": data_list, "labels": labels, "mislabeled": mislabeled,
            "cfg": cfg, "yaml": yaml_path, "trainer": trainer, "ckpt": ckpt,
            "paths": [os.path.join(os.path.dirname(data_list), f"img/{i:05d}.png")
                      for i in range(len(labels))]}


def read_list(path):
    """[(name, label, angle or None)] of a list file, comments skipped."""
    rows = []
    for line in open(path):
        if line.strip() and not line.startswith("#"):
            f = line.split()
            rows.append((f[0], int(f[1]), float(f[2]) if len(f) > 2 else None))
    return rows


def oracle(trained, model=None, weight=None):
    """Dominant centres and angles computed here from the images, the backbone and the
    raw head array: cv2 decode, (x - 127.5) / 127.5, numpy cosines and majority votes.
    `model`, `weight` (float32 values): another run's backbone and centres on the same images."""
    images = np.stack([cv2.cvtColor(cv2.imread(p), cv2.COLOR_BGR2RGB) for p in trained["paths"]])
    x = (images.astype(np.float32).transpose(0, 3, 1, 2) - 127.5) / 127.5
    model = trained["trainer"].backbone if model is None else model
    model.eval()
    with paddle.no_grad():
        emb = np.concatenate([model(paddle.to_tensor(x[i:i + 200])).numpy()
                              for i in range(0, len(x), 200)]).astype(np.float64)
    if weight is None:
        weight = np.load(os.path.join(trained["ckpt"], "head_rank0", "weight.npy"))
    weight = np.asarray(weight, np.float64)
    assert weight.shape == (CLASSES, K, 128)
    labels = trained["labels"]
    e = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    w = weight / np.linalg.norm(weight, axis=2, keepdims=True)
    cos = np.einsum("nd,nkd->nk", e, w[labels])
    picks = cos.argmax(axis=1)
    dominant = np.array([np.bincount(picks[labels == c], minlength=K).argmax()
                         for c in range(CLASSES)])
    angles = np.degrees(np.arccos(np.clip(cos[np.arange(len(labels)), dominant[labels]], -1, 1)))
    return weight, dominant, angles


def test_cleaning_drops_mislabeled_keeps_clean_and_ranks_agree(trained, run_ranks):
    base = str(trained["base"])
    out1, out2 = os.path.join(base, "clean1"), os.path.join(base, "clean2")
    one = run_ranks(TOOL, 1, ["-c", trained["yaml"], "--checkpoint", "latest", "--out", out1,
                              "-o", "Logging.visualdl=true"], cwd=base)
    assert one.status == 0, one.tail()
    assert "samples: kept" in one.output
    two = run_ranks(TOOL, 2, ["-c", trained["yaml"], "--out", out2,
                              "-o", "Global.checkpoint=latest"], cwd=base)
    assert two.status == 0, two.tail()

    kept1, kept2 = read_list(os.path.join(out1, "train_clean.lst")), \
        read_list(os.path.join(out2, "train_clean.lst"))
    assert kept1 == kept2  # 2 launched ranks give the list of 1 process
    dropped = read_list(os.path.join(out1, "dropped.lst"))
    index = {os.path.abspath(p): i for i, p in enumerate(trained["paths"])}
    is_dropped = np.zeros(len(index), bool)
    is_dropped[[index[name] for name, _, _ in dropped]] = True
    assert sorted(index[name] for name, _, _ in kept1 + dropped) == list(range(len(index)))
    assert all(label == trained["labels"][index[name]] for name, label, _ in kept1 + dropped)
    mis = trained["mislabeled"]
    mis_rate, clean_rate = is_dropped[mis].mean(), is_dropped[~mis].mean()
    print(f"\nmislabeled dropped {100 * mis_rate:.1f} %, clean dropped {100 * clean_rate:.1f} %")
    assert mis_rate >= 0.80 and clean_rate <= 0.05

    # the angles and the decisions agree with an independent computation
    weight, dominant, angles = oracle(trained)
    got = {index[name]: angle for name, _, angle in dropped}
    np.testing.assert_allclose([got[i] for i in sorted(got)], angles[sorted(got)], atol=0.02)
    decided = np.abs(angles - 75.0) > 0.05
    np.testing.assert_array_equal(is_dropped[decided], (angles > 75.0)[decided])

    summary = json.load(open(os.path.join(out1, "summary.json")))
    assert summary["samples"] == len(index) and summary["sub_centers"] == K
    assert summary["samples_dropped"] == is_dropped.sum()
    assert summary["threshold_degrees"] == 75.0
    assert summary["classes_kept"] + summary["classes_dropped"] == CLASSES
    assert sum(summary["angle_histogram"]["counts"]) == len(index)
    assert sum(summary["dominance"]["classes_by_dominant_centre"]) == CLASSES
    assert os.path.getsize(os.path.join(out1, "angles.png")) > 1000
    assert os.listdir(os.path.join(out1, "vdl"))

    # (b) the K = 1 checkpoint holds the dominant centres, bit for bit; state zeroed
    k1 = os.path.join(out1, "checkpoint_k1")
    np.testing.assert_array_equal(np.load(os.path.join(k1, "head_rank0", "weight.npy")),
                                  weight[np.arange(CLASSES), dominant].astype(np.float32))
    velocity = np.load(os.path.join(k1, "head_rank0", "opt.weight.velocity.npy"))
    assert velocity.shape == (CLASSES, 128) and not velocity.any()
    meta = json.load(open(os.path.join(k1, "meta.json")))
    assert meta["sub_centers"] == 1 and meta["config"]["Loss"]["sub_centers"] == 1
    assert meta["step"] == STEPS and meta["batch_in_epoch"] == 0

    # training goes on from it with the cleaned list, as the README says
    more = os.path.join(base, "more")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "train.py"), "-c", trained["yaml"],
         "-o", f"Global.checkpoint={k1}", "-o", "Loss.sub_centers=1", "-o", "Data.dataset=list",
         "-o", f"Data.root={os.path.join(out1, 'train_clean.lst')}",
         "-o", f"Global.max_steps={STEPS + 4}", "-o", f"Global.output_dir={more}"],
        capture_output=True, text=True, timeout=300, cwd=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {k1} at step {STEPS}" in proc.stdout
    assert f"{len(kept1)} images" in proc.stdout and f"step {STEPS + 4}/{STEPS + 4}" in proc.stdout
    final = np.load(os.path.join(more, "checkpoints", f"step_{STEPS + 4:08d}", "head_rank0",
                                 "weight.npy"))
    assert final.shape == (CLASSES, 128) and np.isfinite(final).all()


def test_recordio_source_writes_keys_and_a_cleaned_rec(trained, tmp_path):
    """The same images packed as a RecordIO set: the same decisions, the kept records' keys
    and a cleaned rec with exactly the kept images and labels."""
    from plsc.data import RecordIODataset
    from plsc.apps.cleaning import clean_subcenters
    pack_rec = scripts.load("tools/pack_rec.py")
    rec = str(tmp_path / "rec")
    pack_rec.pack(trained["list"], rec, verify=False)
    cfg = run_config(rec, str(trained["base"] / "run"), Data={"dataset": "recordio", "root": rec})
    out = str(tmp_path / "clean")
    summary = clean_subcenters(cfg, trained["ckpt"], 75.0, out, progress=False)
    _, _, angles = oracle(trained)
    kept = summary["arrays"]["kept"]
    decided = np.abs(angles - 75.0) > 0.05
    np.testing.assert_array_equal(kept[decided], (angles <= 75.0)[decided])
    rows = read_list(os.path.join(out, "train_clean.lst"))
    assert open(os.path.join(out, "train_clean.lst")).readline().startswith("# keys of the records of")
    assert [int(key) for key, _, _ in rows] == [int(i) + 1 for i in np.flatnonzero(kept)]  # keys 1..N
    cleaned = RecordIODataset(summary["outputs"]["rec"], train=False)
    assert len(cleaned) == kept.sum() and cleaned.num_classes == CLASSES
    source = RecordIODataset(rec, train=False)
    for j, i in enumerate(np.flatnonzero(kept)[:5]):
        image, label = cleaned[j]
        np.testing.assert_array_equal(image, source[int(i)][0])
        assert label == trained["labels"][i]


@pytest.mark.parametrize("args,message", [
    (["--threshold", "0"], "in (0, 180), got 0"),
    (["--threshold", "180"], "in (0, 180), got 180"),
    (["--threshold", "-5"], "in (0, 180), got -5"),
    (["--checkpoint", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
])
def test_bad_arguments_are_named(trained, args, message, capsys):
    module = scripts.load(TOOL)
    assert module.main(["-c", trained["yaml"]] + args) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_k1_checkpoint_has_nothing_to_clean(trained, tmp_path, capsys):
    from plsc.checkpoint import write_k1_checkpoint
    k1 = write_k1_checkpoint(trained["ckpt"], str(tmp_path / "k1"), np.zeros(CLASSES, np.int64))
    module = scripts.load(TOOL)
    assert module.main(["-c", trained["yaml"], "--checkpoint", k1]) == 2
    err = capsys.readouterr().err
    assert "sub_centers=1" in err and "nothing to clean" in err and k1 in err


@pytest.mark.parametrize("dtype,state_dtype", [("bfloat16", None), ("int8", None),
                                               ("int8", "int4")])
def test_narrow_adamw_head_gives_the_dominant_bits_and_resumes(trained, tmp_path, dtype,
                                                               state_dtype):
    """A bfloat16 or int8 K = 3 head (int8: with 8- or 4-bit moments) trained a few steps with
    AdamW: the K = 1 checkpoint stores the dominant centres' bits as they were (int8: each
    centre's codes and scale), in the same dtype, its AdamW state (moments and step counts) is
    zero in the shapes and dtypes of a K = 1 head (4 bits: records of block scales and 64
    bytes), and a K = 1 run resumes from it."""
    from plsc.apps.cleaning import clean_subcenters
    out = str(tmp_path / "run")
    opt = {"name": "adamw", "lr": 1e-3, "head_state_dtype": state_dtype}
    cfg = run_config(trained["list"], out, Global={"max_steps": 3},
                     Loss={"param_dtype": dtype}, Optimizer=opt)
    run = Trainer(cfg)
    run.train()
    ckpt = os.path.join(out, "checkpoints", "step_00000003")
    summary = clean_subcenters(cfg, ckpt, 75.0, str(tmp_path / "clean"), progress=False)
    bits = np.load(os.path.join(ckpt, "head_rank0", "weight.npy"))
    if dtype == "bfloat16":
        assert bits.dtype == np.uint16 and bits.shape == (CLASSES, K, 128)
    else:  # a record (scale, 128 codes) a centre
        assert bits.dtype.names == ("scale", "codes") and bits.shape == (CLASSES, K)
    k1 = summary["outputs"]["checkpoint_k1"]
    dominant = summary["arrays"]["dominant"]
    np.testing.assert_array_equal(np.load(os.path.join(k1, "head_rank0", "weight.npy")),
                                  bits[np.arange(CLASSES), dominant])
    meta = json.load(open(os.path.join(k1, "meta.json")))
    assert meta["head_dtypes"]["weight"] == dtype and meta["sub_centers"] == 1
    # The dominant centres from cosines computed here: the bfloat16 bits widened to float32
    # (exact: bfloat16 is float32's upper half; int8: codes times scale / 127), the run's
    # backbone, numpy majority votes.
    if dtype == "bfloat16":
        centres = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        centres = bits["codes"] * (bits["scale"][..., None] / np.float32(127))
    _, expect, _ = oracle(trained, model=run.backbone, weight=centres)
    np.testing.assert_array_equal(dominant, expect)
    source = json.load(open(os.path.join(ckpt, "meta.json")))["head_dtypes"]
    width = 64 if state_dtype == "int4" else 128  # two 4-bit codes a byte
    for name, shape in (("moment1", (CLASSES, width)), ("moment2", (CLASSES, width)),
                        ("steps", (CLASSES,))):
        assert meta["head_dtypes"][f"opt.weight.{name}"] == source[f"opt.weight.{name}"]
        state = np.load(os.path.join(k1, "head_rank0", f"opt.weight.{name}.npy"))
        if state.dtype.names:  # 8- or 4-bit records: zero codes and scales
            assert state.shape == shape[:1] and state["codes"].shape == shape, name
            assert not state["codes"].any() and not state["scale"].any(), name
        else:
            assert state.shape == shape and not state.any(), name
    if state_dtype == "int4":
        assert source["opt.weight.moment2"] == "uint4_log"
    more = run_config(str(tmp_path / "clean" / "train_clean.lst"), str(tmp_path / "more"),
                      Global={"max_steps": 5, "checkpoint": k1}, Loss={"param_dtype": dtype,
                                                                        "sub_centers": 1},
                      Optimizer=opt)
    trainer = Trainer(more)
    assert trainer.step == 3
    history = trainer.train()
    assert [s for s, _ in history] == [4, 5] and np.isfinite([v for _, v in history]).all()
