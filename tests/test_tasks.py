"""Evaluation, export, extraction and the Entry API on a small trained run."""
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from trainer_common import config, make_data
from oracles import rel_err
from plsc.config import dump_config
from plsc.train import Trainer

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(os.path.dirname(HERE), "tools")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Four steps with verification before, during and after training; the config as YAML."""
    data = make_data(str(tmp_path_factory.mktemp("tasks_data")))
    out = str(tmp_path_factory.mktemp("tasks_run"))
    cfg = config(data, out, Global={"max_steps": 4},
                 Eval={"root": data, "targets": ["val"], "interval": 2, "batch_size": 16,
                       "before_training": True})
    trainer = Trainer(cfg)
    trainer.train()
    path = os.path.join(out, "config.yaml")
    with open(path, "w") as f:
        f.write(dump_config(cfg))
    return {"cfg": cfg, "trainer": trainer, "yaml": path, "data": data, "out": out}


def tool(name, *args):
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, name)] + list(args),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_best_backbone_is_kept_per_target(run):
    history = [(step, r["val"]["accuracy"]) for step, r in run["trainer"].eval_history if step > 0]
    best_step, best = max(history, key=lambda h: h[1])
    summary = json.load(open(os.path.join(run["out"], "best_val", "best.json")))
    assert summary["accuracy"] == best and summary["step"] == best_step
    assert os.path.isfile(os.path.join(run["out"], "best_val", "backbone.pdparams"))


def test_eval_tool_prints_table_and_roc(run):
    text = tool("eval.py", "-c", run["yaml"], "-o", "Global.checkpoint=latest")
    row = next(line for line in text.splitlines() if line.startswith("val "))
    final = run["trainer"].eval_history[-1][1]["val"]
    assert float(row.split()[1]) == pytest.approx(final["accuracy"], abs=5e-5)
    assert "TAR@1e-3" in text
    assert os.path.getsize(os.path.join(run["out"], "roc.png")) > 1000


def test_eval_tool_without_weights_says_what_to_set(run):
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, "eval.py"), "-c", run["yaml"],
                           "-o", "Global.checkpoint=null"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "set Global.checkpoint" in proc.stderr


def test_export_matches_dynamic_graph(run, tmp_path):
    out = str(tmp_path / "export")
    text = tool("export.py", "-c", run["yaml"], "-o", "Global.checkpoint=latest", "--output", out)
    assert "paddle:" in text
    model = run["trainer"].backbone
    model.eval()
    x = np.random.RandomState(0).normal(size=(3, 3, 16, 16)).astype("float32")
    expect = model(paddle.to_tensor(x)).numpy()
    loaded = paddle.jit.load(os.path.join(out, "inference"))
    # float32 sums of hundreds of products: errors scale with the output's magnitude (up to ~100
    # here), so they are measured relative to it (about 2^-24 times the terms summed, < 1e-5).
    assert rel_err(loaded(paddle.to_tensor(x)).numpy(), expect) < 1e-5
    ort = pytest.importorskip("onnxruntime")
    assert "onnx:" in text
    session = ort.InferenceSession(os.path.join(out, "model.onnx"))
    got = session.run(None, {session.get_inputs()[0].name: x})[0]
    assert rel_err(got, expect) < 1e-5


def test_extract_writes_embeddings_and_labels(run, tmp_path):
    out = str(tmp_path / "emb.npy")
    tool("extract.py", "-c", run["yaml"], "-o", "Global.checkpoint=latest", "--input", run["data"],
         "--output", out)
    emb, labels = np.load(out), np.load(str(tmp_path / "emb_labels.npy"))
    from plsc.data import RecordIODataset
    ds = RecordIODataset(run["data"], image_size=(16, 16), train=False)
    assert emb.shape == (len(ds), 32)
    np.testing.assert_array_equal(labels, [ds[i][1] for i in range(len(ds))])
    model = run["trainer"].backbone
    model.eval()
    first = model(paddle.to_tensor(np.stack([ds[i][0] for i in range(4)]))).numpy()
    # another batch and thread count: oneDNN's blocked kernels sum in another order, so the
    # error is measured against the embeddings' scale (up to ~150 here), as the export's above
    assert rel_err(emb[:4], first) < 1e-5


def pack_accuracies(model, path):
    """The 10-fold verification accuracies `model` may have on the pack at `path`, written
    independently: pickle + cv2 decode, (x - 127.5) / 127.5, embedding of image + embedding of
    its flip, L2 normalisation, squared distances, thresholds 0, 0.01, ..., 3.99 (insightface's).
    One accuracy, unless a distance lies within float32 noise (1e-5) of a threshold: then it
    may fall on either side in the code under test, and each side's accuracy is returned."""
    import pickle

    import cv2
    from test_metrics import brute_kfold
    with open(path, "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    imgs = np.stack([cv2.cvtColor(cv2.imdecode(np.frombuffer(bytes(b), np.uint8), cv2.IMREAD_COLOR),
                                  cv2.COLOR_BGR2RGB) for b in bins])
    assert imgs.shape[1:] == (16, 16, 3)
    x = (imgs.transpose(0, 3, 1, 2).astype("float32") - 127.5) / 127.5
    model.eval()
    with paddle.no_grad():
        e = (model(paddle.to_tensor(x)).numpy().astype(np.float64)
             + model(paddle.to_tensor(np.ascontiguousarray(x[..., ::-1]))).numpy())
    e /= np.sqrt((e * e).sum(axis=1, keepdims=True))
    dist = ((e[0::2] - e[1::2]) ** 2).sum(axis=1)
    grid = np.arange(0.0, 4.0, 0.01)
    gap = np.abs(dist[:, None] - grid[None, :])
    near = np.flatnonzero(gap.min(axis=1) <= 1e-5)
    assert len(near) <= 3, "too many distances on a threshold to enumerate"
    found = set()
    for sides in itertools.product((-1e-5, 1e-5), repeat=len(near)):
        moved = dist.copy()
        moved[near] = grid[gap[near].argmin(axis=1)] + np.asarray(sides)
        found.add(float(brute_kfold(moved, np.asarray(issame, bool), 10, grid).mean()))
    return sorted(found)


def test_entry_api(run, tmp_path):
    from plsc import Entry
    with pytest.raises(ValueError, match="class_num must be a positive integer, got 0"):
        Entry().set_class_num(0)
    with pytest.raises(ValueError, match="loss_type must be one of dist_arcface"):
        Entry().set_loss_type("dist_arc")
    with pytest.raises(ValueError, match="unknown model 'IResNet500'; did you mean 'IResNet50'"):
        Entry().set_model_name("IResNet500")
    with pytest.raises(ValueError, match=r"sample_ratio must be in \(0, 1\]"):
        Entry().set_sample_ratio(1.5)

    ins = Entry.from_config(run["yaml"], ["Eval.before_training=false"])
    ins.set_model_save_dir(str(tmp_path / "entry")).set_train_steps(2).set_loss_type("dist_cosface")
    ins.set_class_num(24).set_sample_ratio(0.5).set_log_period(1).set_seed(1)
    history = ins.train()
    assert [s for s, _ in history] == [1, 2]
    assert ins.get_config()["Loss"]["margin"] == "cosface"
    reports = ins.test()
    paths = ins.convert_for_prediction(str(tmp_path / "entry_export"), onnx=False)
    assert os.path.isfile(paths["paddle"] + ".pdiparams")
    images = [(np.random.RandomState(i).rand(16, 16, 3) * 255).astype(np.uint8) for i in range(3)]
    emb = ins.predict(images)
    from plsc.parts import build_backbone, load_pretrained
    from plsc.checkpoint import find_checkpoint
    from plsc.checkpoint.layout import BACKBONE
    cfg = ins.get_config()
    ref = build_backbone(cfg)
    load_pretrained(ref, os.path.join(find_checkpoint("latest", cfg["Global"]["output_dir"]), BACKBONE))
    ref.eval()
    x = np.stack([(im.transpose(2, 0, 1).astype("float32") - 127.5) / 127.5 for im in images])
    assert rel_err(emb, ref(paddle.to_tensor(x)).numpy()) < 1e-5  # float32, see the export test
    # ins.test() against the verification protocol done here: the pack unpickled and decoded
    # with cv2, the reference backbone on the images and their flips, brute-force 10 folds.
    possible = pack_accuracies(ref, os.path.join(run["data"], "val.bin"))
    assert any(reports["val"]["accuracy"] == pytest.approx(a, abs=1e-12) for a in possible), possible


def test_entry_demo_script_runs(tmp_path):
    demo = os.path.join(os.path.dirname(HERE), "demo", "entry_demo.py")
    proc = subprocess.run([sys.executable, demo, "--steps", "2", "--output", str(tmp_path / "o"),
                           "--data", str(tmp_path / "d")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val " in proc.stdout and "'paddle':" in proc.stdout
