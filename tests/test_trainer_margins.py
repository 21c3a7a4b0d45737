"""The trainer with AdaFace and sub-centres (Loss.margin: adaface, Loss.sub_centers): bit-exact
resume (AdaFace's running statistics and the K-centre rows travel with the checkpoint),
the checkpoint layout of K-centre arrays, re-sharding and export of them, and the
config/Entry surface."""
import json
import os

import numpy as np
import paddle
import pytest

from trainer_common import CLASSES, config, make_backbone, make_data
from plsc.config import ConfigError
from plsc.train import Trainer
from plsc.checkpoint import export_classifier, reshard_checkpoint
from plsc.entry import Entry
from plsc.loss import AdaFace


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("synthetic")))


def bits(t):
    a = np.array(t.numpy())
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def head_state(trainer):
    out = {"weight": bits(trainer.head.weight)}
    for key, value in trainer.head_opt.state_dict().items():
        if key != "step_count":
            out[f"opt.{key}"] = bits(value)
    for key, value in trainer.head.state_dict().items():
        if key.startswith("margin."):
            out[key] = bits(value)
    return out


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


CASES = {
    "adaface": dict(Loss={"margin": "adaface"}),
    "adaface_k3_pfc_bf16": dict(Loss={"margin": "adaface", "sub_centers": 3, "sample_ratio": 0.5,
                                      "param_dtype": "bfloat16"}),
    "arcface_k3_chunked": dict(Loss={"sub_centers": 3, "chunk_size": 5}),
    "cosface_k2_adamw": dict(Loss={"margin": "cosface", "m3": 0.35, "sub_centers": 2},
                             Optimizer={"name": "adamw", "lr": 0.01, "weight_decay": 0.01}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_equals_uninterrupted(tmp_path, data_root, name):
    """Six steps straight vs three, a checkpoint, three more from another initial backbone:
    losses, centres, optimizer state and AdaFace's running statistics bit for bit."""
    sections = CASES[name]
    full = Trainer(config(data_root, str(tmp_path / "a"), **sections), backbone=make_backbone(0))
    k = full.head.sub_centers
    assert tuple(full.head.weight.shape) == (CLASSES * k, 32)
    history = full.train()
    ckpt = os.path.join(str(tmp_path / "a"), "checkpoints", "step_00000003")
    with open(os.path.join(ckpt, "meta.json")) as f:
        meta = json.load(f)
    assert meta["sub_centers"] == k
    stored = np.load(os.path.join(ckpt, "head_rank0", "weight.npy"), mmap_mode="r")
    assert stored.shape == ((CLASSES, k, 32) if k > 1 else (CLASSES, 32))
    if isinstance(full.head.margin, AdaFace):
        assert sorted(meta["margin_state"]) == ["batch_mean", "batch_std"]
        assert meta["margin_state"]["batch_mean"] != 20.0  # updated by the steps
    resumed = Trainer(config(data_root, str(tmp_path / "b"), Global={"checkpoint": ckpt},
                             **sections), backbone=make_backbone(1))
    rest = resumed.train()
    np.testing.assert_array_equal([v for _, v in rest], [v for _, v in history[3:]])
    assert_same(head_state(resumed), head_state(full))


def test_adaface_statistics_follow_the_formula_and_stop_in_eval(tmp_path, data_root):
    """The trainer's AdaFace statistics after six steps equal the running formula applied to
    the global batches' clipped norms (computed here in float64 from the backbone's output,
    not from the norms the head computes), and evaluation leaves them alone."""
    cfg = config(data_root, str(tmp_path), Loss={"margin": "adaface", "adaface_t_alpha": 0.3})
    trainer = Trainer(cfg, backbone=make_backbone(0))
    norms = []

    def spy(layer, inputs, out):  # the embeddings the head receives (one process: all of them)
        if layer.training:
            e = out.numpy().astype(np.float64)
            norms.append(np.clip(np.sqrt((e * e).sum(axis=1)), 0.001, 100.0))

    trainer.backbone.register_forward_post_hook(spy)
    trainer.train()
    mean, std = 20.0, 100.0
    for n in norms:
        mean = 0.3 * n.mean() + 0.7 * mean
        std = 0.3 * n.std(ddof=1) + 0.7 * std
    assert len(norms) == 6
    margin = trainer.head.margin
    np.testing.assert_allclose([float(margin.batch_mean), float(margin.batch_std)], [mean, std],
                               rtol=1e-6)
    before = [float(margin.batch_mean), float(margin.batch_std)]
    trainer.head.eval()
    x = paddle.rand([4, 32])
    trainer.head(x, paddle.arange(4))
    assert [float(margin.batch_mean), float(margin.batch_std)] == before


def test_k_centre_checkpoint_reshards_and_exports(tmp_path, data_root):
    cfg = config(data_root, str(tmp_path / "a"), Loss={"sub_centers": 3},
                 Global={"max_steps": 3})
    trainer = Trainer(cfg, backbone=make_backbone(0))
    trainer.train()
    ckpt = os.path.join(str(tmp_path / "a"), "checkpoints", "step_00000003")
    weight = trainer.head.weight.numpy().reshape(CLASSES, 3, 32)
    out = export_classifier(ckpt, str(tmp_path / "w.npy"))
    np.testing.assert_array_equal(np.load(out), weight)
    three = reshard_checkpoint(ckpt, str(tmp_path / "three"), 3)
    for r in range(3):
        part = np.load(os.path.join(three, f"head_rank{r}", "weight.npy"))
        assert part.shape == (CLASSES // 3, 3, 32)
        np.testing.assert_array_equal(part, weight[r * 8:(r + 1) * 8])
    # The re-sharded checkpoint resumes in one process like the original.
    a = Trainer(config(data_root, str(tmp_path / "b"), Loss={"sub_centers": 3},
                       Global={"checkpoint": three}), backbone=make_backbone(1))
    np.testing.assert_array_equal(a.head.weight.numpy().reshape(CLASSES, 3, 32), weight)


def test_checkpoint_with_other_sub_centers_is_refused(tmp_path, data_root):
    cfg = config(data_root, str(tmp_path / "a"), Loss={"sub_centers": 2}, Global={"max_steps": 3})
    Trainer(cfg, backbone=make_backbone(0)).train()
    ckpt = os.path.join(str(tmp_path / "a"), "checkpoints", "step_00000003")
    with pytest.raises(ConfigError, match="sub_centers=2.*1"):
        Trainer(config(data_root, str(tmp_path / "b"), Global={"checkpoint": ckpt}),
                backbone=make_backbone(0))


def test_config_and_entry(tmp_path):
    with pytest.raises(ConfigError, match="sub_centers=3 needs a normalised margin"):
        config("x", str(tmp_path), Loss={"margin": "softmax", "sub_centers": 3})
    with pytest.raises(ConfigError, match="sub_centers must be >= 1"):
        config("x", str(tmp_path), Loss={"sub_centers": 0})
    with pytest.raises(ConfigError, match="adaface_t_alpha"):
        config("x", str(tmp_path), Loss={"margin": "adaface", "adaface_t_alpha": 2.0})
    raw = Entry().set_adaface(m=0.5, h=0.25).set_sub_centers(3)._raw["Loss"]
    assert raw == {"margin": "adaface", "adaface_m": 0.5, "adaface_h": 0.25, "sub_centers": 3}
    with pytest.raises(ValueError, match="sub_centers"):
        Entry().set_sub_centers(0)
    with pytest.raises(ValueError, match="adaface_h"):
        Entry().set_adaface(h="high")
