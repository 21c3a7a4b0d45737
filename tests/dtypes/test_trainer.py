"""The trainer with 16-bit class centres (Loss.param_dtype) in one process: bit-exact resume
and reproducibility with stochastic rounding, a skipped loss-scaled step that leaves the head
and its optimizer state alone, the fused head update against the separate one, and the
config/Entry surface of these settings."""
import os

import numpy as np
import paddle
import pytest
import yaml
from paddle import nn

from trainer_common import (CLASSES, IMAGE, assert_same_bits, backbone_bits, bits, config,
                            head_bits, make_backbone, make_data)
from plsc.config import ConfigError, load_config
from plsc.train import Trainer
from plsc.train.amp import LossScaler
from plsc.entry import Entry


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("synthetic")))


def bf16_ulp(bits16):
    """The spacing of bfloat16 at each value given by its bits (normal values)."""
    exponent = (bits16.astype(np.int32) >> 7) & 0xFF
    return np.ldexp(1.0, exponent - 127 - 7)


# ------------------------------------------------------------------ 1. resume, seeds

@pytest.mark.parametrize("dtype,ratio,opt,k,state_dtype", [
    ("bfloat16", 1.0, "sgd", 1, None), ("bfloat16", 0.5, "sgd", 1, None),
    ("int8", 1.0, "sgd", 1, None), ("int8", 0.5, "sgd", 3, None), ("int8", 0.5, "adamw", 1, None),
    ("int8", 0.5, "sgd", 3, "int4"), ("int8", 1.0, "adamw", 1, "int4")])
def test_narrow_resume_equals_uninterrupted(tmp_path, data_root, dtype, ratio, opt, k,
                                            state_dtype):
    """bfloat16 or int8 centres and optimizer state (or 4-bit state) written with stochastic
    rounding: resuming at step 3 gives the uninterrupted run's losses, weights, every optimizer
    state array (8 and 4 bits: codes and scales) and step count bit for bit (the rounding bits
    depend on the restored step count); `k` sub-centres a class."""
    from plsc.storage import name as storage_name
    sections = dict(Loss={"sample_ratio": ratio, "param_dtype": dtype, "sub_centers": k},
                    Optimizer={"name": opt, "head_state_dtype": state_dtype,
                               **({"lr": 0.01} if opt == "adamw" else {})})
    full = Trainer(config(data_root, str(tmp_path / "a"), **sections), backbone=make_backbone(0))
    assert full.head_opt.rounding == "stochastic" and full.head_opt.state_dtype == state_dtype
    history = full.train()
    assert [s for s, _ in history] == [1, 2, 3, 4, 5, 6]
    state = full.head_opt.state_dict()
    first = "weight.velocity" if opt == "sgd" else "weight.moment2"
    assert storage_name(full.head.weight) == dtype
    want_map = {(None, "sgd"): dtype, (None, "adamw"): "uint8_log",
                ("int4", "sgd"): "int4", ("int4", "adamw"): "uint4_log"}
    assert storage_name(state[first]) == want_map[state_dtype, opt]
    assert int(state["step_count"]) == 6
    ckpt = os.path.join(str(tmp_path / "a"), "checkpoints", "step_00000003")
    # Another initial backbone: everything must come from the checkpoint.
    resumed = Trainer(config(data_root, str(tmp_path / "b"), Global={"checkpoint": ckpt},
                             **sections), backbone=make_backbone(1))
    assert resumed.step == 3 and resumed.head_opt.step_count == 3
    assert "head optimizer state" not in open(str(tmp_path / "b" / "train.log")).read()
    rest = resumed.train()
    assert [s for s, _ in rest] == [4, 5, 6]
    np.testing.assert_array_equal([v for _, v in rest], [v for _, v in history[3:]])
    (got, got_count), (want, want_count) = head_bits(resumed), head_bits(full)
    if dtype == "bfloat16":
        assert sorted(want) == ["opt.weight.velocity", "weight"]
        assert want["weight"].dtype == want["opt.weight.velocity"].dtype == np.uint16
    else:
        states = ["velocity"] if opt == "sgd" else ["moment1", "moment2"]
        assert sorted(want) == sorted([f"opt.weight.{s}.{p}" for s in states
                                       for p in ("codes", "scale")]
                                      + (["opt.weight.steps"] if opt == "adamw" else [])
                                      + ["weight.codes", "weight.scale"])
    assert_same_bits(got, want)
    assert got_count == want_count == 6
    assert int(resumed.head_opt.state_dict()["step_count"]) == 6
    assert_same_bits(backbone_bits(resumed), backbone_bits(full))


def test_bfloat16_runs_are_reproducible_and_the_rounding_follows_the_seed(tmp_path, data_root):
    """Two runs with one Global.seed are bit-identical; another Global.seed changes the bits.
    The stochastic rounding's seed is Global.seed: one step from the same weights on the same
    batch (sample_ratio 1, so nothing else draws from the seed) with another Global.seed
    stores other bits, each value still one of the two bfloat16 neighbours of the same float32
    result (the runs differ by at most one bfloat16 ulp), and the backbone alike."""
    def trainer(name, seed=0, ratio=0.5):
        t = Trainer(config(data_root, str(tmp_path / name), Global={"seed": seed, "max_steps": 2},
                           Loss={"param_dtype": "bfloat16", "sample_ratio": ratio},
                           Checkpoint={"interval": 100}), backbone=make_backbone(0))
        assert t.head_opt.seed == seed
        return t

    a, b = trainer("a"), trainer("b")
    ha, hb = a.train(), b.train()
    assert [v for _, v in ha] == [v for _, v in hb]
    assert_same_bits(head_bits(a)[0], head_bits(b)[0])
    assert_same_bits(backbone_bits(a), backbone_bits(b))
    c = trainer("c", seed=1)
    c.train()
    assert not np.array_equal(bits(c.head.weight), bits(a.head.weight))

    rng = np.random.RandomState(0)
    images = paddle.to_tensor(rng.normal(size=(4, 3, IMAGE, IMAGE)).astype("float32"))
    labels = paddle.to_tensor(rng.randint(0, CLASSES, 4).astype("int64"))
    one = [trainer("d0", 0, ratio=1.0), trainer("d1", 1, ratio=1.0)]
    one[1].head.weight.set_value(one[0].head.weight)  # Global.seed also draws the centres
    assert_same_bits({"w": bits(one[1].head.weight)}, {"w": bits(one[0].head.weight)})
    for t in one:
        t.train_step([(images, labels)])
    w0, w1 = bits(one[0].head.weight), bits(one[1].head.weight)
    assert (w0 != w1).any()
    diff = np.abs(one[0].head.weight.astype("float32").numpy().astype(np.float64)
                  - one[1].head.weight.astype("float32").numpy())
    assert (diff <= np.maximum(bf16_ulp(w0), bf16_ulp(w1))).all()
    assert_same_bits(backbone_bits(one[0]), backbone_bits(one[1]))


# ------------------------------------------------- 3. a skipped loss-scaled step on CPU

class PoisonableNet(nn.Layer):
    """FlatNet whose embeddings' gradient becomes non-finite (x inf: inf, or NaN where it was
    0) while `poison` is set, as float16 overflow would make it."""

    def __init__(self):
        super().__init__()
        self.net = make_backbone(0)
        self.poison = False

    def forward(self, x):
        emb = self.net(x)
        if self.poison:
            emb.register_hook(lambda g: g * float("inf"))
        return emb


@pytest.mark.parametrize("dtype,ratio,margin", [
    ("float32", 1.0, "arcface"), ("bfloat16", 0.5, "arcface"),
    ("float32", 0.5, "softmax"), ("bfloat16", 1.0, "softmax"),  # softmax: a bias too
    ("int8", 1.0, "softmax"), ("int8", 0.5, "arcface")])
def test_non_finite_embedding_gradient_leaves_head_and_backbone_unchanged(
        tmp_path, data_root, dtype, ratio, margin):
    """Stands in for float16 AMP on a GPU with dynamic loss scaling, which the trainer refuses
    on the CPU: the trainer's loss scaler is enabled after construction, and a hook makes the
    embeddings' gradient non-finite as a float16 overflow would. The step is skipped (counted,
    scale halved); since a skip must stay possible the head is not updated inside the backward
    (`fused_head_update` is False), and every head row, its optimizer state and step count,
    and the backbone keep their bits. The same step with a finite gradient changes them."""
    backbone = PoisonableNet()
    trainer = Trainer(config(data_root, str(tmp_path / "amp"),
                             Loss={"param_dtype": dtype, "sample_ratio": ratio, "margin": margin}),
                      backbone=backbone)
    assert trainer.fused_head_update  # the default, without loss scaling
    trainer.scaler = LossScaler(True, init_scale=1024.0)
    assert not trainer.fused_head_update
    rng = np.random.RandomState(7)
    batches = [(paddle.to_tensor(rng.normal(size=(4, 3, IMAGE, IMAGE)).astype("float32")),
                paddle.to_tensor(rng.randint(0, CLASSES, 4).astype("int64"))) for _ in range(2)]
    trainer.train_step([batches[0]])  # a good step first: the optimizer state exists, non-zero
    assert trainer.scaler.skipped == 0 and trainer.scaler.scale == 1024.0
    head0, count0 = head_bits(trainer)
    if dtype == "int8":  # the dense gradient kept by the head is dropped with the step
        assert head0["weight.codes"].dtype == np.uint8 and trainer.head.row_gradient("weight") is None
    else:
        assert head0["weight"].dtype == (np.uint16 if dtype == "bfloat16" else np.uint32)
    assert ("bias" in head0) == (margin == "softmax")
    assert any(k.startswith("opt.") and v.any() for k, v in head0.items())
    backbone0 = backbone_bits(trainer)

    backbone.poison = True
    trainer.train_step([batches[1]])
    assert trainer.scaler.skipped == 1 and trainer.scaler.scale == 512.0 and trainer.step == 2
    head1, count1 = head_bits(trainer)
    assert_same_bits(head1, head0)
    assert count1 == count0 == 1
    assert_same_bits(backbone_bits(trainer), backbone0)

    backbone.poison = False  # the same batch, finite: applied
    trainer.train_step([batches[1]])
    assert trainer.scaler.skipped == 1 and trainer.scaler.scale == 512.0 and trainer.step == 3
    head2, count2 = head_bits(trainer)
    assert count2 == 2
    for key in head0:
        assert not np.array_equal(head2[key], head0[key]), key
    assert any(not np.array_equal(v, backbone0[k]) for k, v in backbone_bits(trainer).items())


# ------------------------------------------------------- 4. config, Entry, fused update

def test_param_dtype_int4_in_a_yaml_names_the_key_and_the_choices(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"Loss": {"num_classes": 10, "param_dtype": "int4"},
                                    "Data": {"root": "/data"}}))
    with pytest.raises(ConfigError, match=r"Loss\.param_dtype must be one of float32, bfloat16, "
                                          r"float16, int8, got 'int4'"):
        load_config(str(path))
    path.write_text(yaml.safe_dump({"Loss": {"num_classes": 10, "param_dtype": "bfloat16"},
                                    "Data": {"root": "/data"}}))
    assert load_config(str(path))["Loss"]["param_dtype"] == "bfloat16"


def test_head_state_dtype_int4_is_a_state_choice(tmp_path):
    path = tmp_path / "c.yaml"
    raw = {"Loss": {"num_classes": 10}, "Data": {"root": "/data"},
           "Optimizer": {"head_state_dtype": "int4"}}
    path.write_text(yaml.safe_dump(raw))
    assert load_config(str(path))["Optimizer"]["head_state_dtype"] == "int4"
    raw["Optimizer"]["head_state_dtype"] = "int2"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"Optimizer\.head_state_dtype must be one of float32, "
                                          r"bfloat16, float16, int8, int4 or null, got 'int2'"):
        load_config(str(path))
    cfg = Entry().set_class_num(10).set_dataset_dir("/data").set_param_dtype(
        "int8", state_dtype="int4").get_config()
    assert cfg["Optimizer"]["head_state_dtype"] == "int4"


def test_entry_set_param_dtype():
    entry = Entry().set_class_num(10).set_dataset_dir("/data")
    assert entry.get_config()["Loss"]["param_dtype"] == "float32"  # the default
    assert entry.set_param_dtype("bfloat16") is entry
    cfg = entry.get_config()
    assert cfg["Loss"]["param_dtype"] == "bfloat16" and cfg["Optimizer"]["head_state_dtype"] is None
    with pytest.raises(ValueError, match=r"dtype must be one of float32, bfloat16, float16, "
                                         r"int8, got 'int4'"):
        entry.set_param_dtype("int4")
    assert entry.get_config()["Loss"]["param_dtype"] == "bfloat16"  # unchanged by the error
    cfg = entry.set_param_dtype("float32", state_dtype="int8").get_config()
    assert cfg["Loss"]["param_dtype"] == "float32" and cfg["Optimizer"]["head_state_dtype"] == "int8"


@pytest.mark.parametrize("dtype,ratio", [("float32", 1.0), ("float32", 0.5), ("bfloat16", 0.5),
                                         ("int8", 1.0), ("int8", 0.5)])
def test_unfused_head_update_trains_like_the_fused_one(tmp_path, data_root, dtype, ratio):
    """Optimizer.fused_head_update: false applies the head optimizer after the backward
    (`head_opt.step`; a dense int8 head's gradient is kept by the head, in float32); the fused
    update inside the backward gives the same run bit for bit: losses, head rows, optimizer
    state and backbone."""
    runs = []
    for fused in (True, False):
        trainer = Trainer(config(data_root, str(tmp_path / str(fused)), Global={"max_steps": 3},
                                 Loss={"param_dtype": dtype, "sample_ratio": ratio},
                                 Optimizer={"fused_head_update": fused}),
                          backbone=make_backbone(0))
        assert trainer.fused_head_update is fused
        calls = {"step": 0, "fused_update": 0}
        for name in calls:
            def spy(*args, _name=name, _orig=getattr(trainer.head_opt, name), **kw):
                calls[_name] += 1
                return _orig(*args, **kw)
            setattr(trainer.head_opt, name, spy)
        history = trainer.train()
        assert calls == ({"step": 0, "fused_update": 3} if fused else {"step": 3, "fused_update": 0})
        runs.append((history, trainer))
    (h_fused, t_fused), (h_sep, t_sep) = runs
    assert [v for _, v in h_fused] == [v for _, v in h_sep]
    (a, ca), (b, cb) = head_bits(t_fused), head_bits(t_sep)
    assert_same_bits(a, b)
    assert ca == cb == 3
    assert_same_bits(backbone_bits(t_fused), backbone_bits(t_sep))


def test_float32_checkpoint_resumes_as_int8_and_back(tmp_path, data_root):
    """A float32 run's step-3 checkpoint resumed with Loss.param_dtype=int8: the centres and
    the momentum are the float32 values quantised to nearest (plsc.storage.int8's rounding, whose
    oracle tests are tests/dtypes/test_quantized.py's), and training goes on; that run's step-6
    checkpoint resumed as float32 holds the int8 rows' values exactly."""
    from plsc.storage.int8 import Int8Rows, quantize
    from plsc.storage import read as rows_f32
    full = Trainer(config(data_root, str(tmp_path / "f32")), backbone=make_backbone(0))
    full.train()
    step3 = os.path.join(str(tmp_path / "f32"), "checkpoints", "step_00000003")
    as8 = Trainer(config(data_root, str(tmp_path / "i8"), Global={"checkpoint": step3},
                         Loss={"param_dtype": "int8"}), backbone=make_backbone(1))
    assert as8.step == 3 and isinstance(as8.head.weight, Int8Rows)
    import plsc.checkpoint as ckpt
    for name, t in (("weight", as8.head.weight),
                    ("opt.weight.velocity", as8.head_opt.state_dict()["weight.velocity"])):
        codes, scale = quantize(paddle.to_tensor(ckpt.load_head_rows(step3, name, 0, CLASSES)))
        np.testing.assert_array_equal(t.codes.numpy(), codes.numpy(), err_msg=name)
        np.testing.assert_array_equal(t.scale.numpy(), scale.numpy(), err_msg=name)
    history = as8.train()
    assert [s for s, _ in history] == [4, 5, 6] and np.isfinite([v for _, v in history]).all()
    step6 = os.path.join(str(tmp_path / "i8"), "checkpoints", "step_00000006")
    back = Trainer(config(data_root, str(tmp_path / "back"), Global={"checkpoint": step6,
                                                                     "max_steps": 7}),
                   backbone=make_backbone(1))
    assert back.head.weight.dtype == paddle.float32
    np.testing.assert_array_equal(back.head.weight.numpy(), rows_f32(as8.head.weight).numpy())
    np.testing.assert_array_equal(back.head_opt.state_dict()["weight.velocity"].numpy(),
                                  rows_f32(as8.head_opt.state_dict()["weight.velocity"]).numpy())
    assert [s for s, _ in back.train()] == [7]


def assert_nearest_4_bits(got, x, name):
    """4-bit rows `got` hold float32 values `x` written to nearest under map `name`: block
    scales, codes (ties aside) and error bound of tests/dtypes/test_quantized4.py's oracle."""
    from dtypes import test_quantized4 as q4
    codes, scale = got.codes.numpy(), got.scale.numpy()
    np.testing.assert_array_equal(scale, q4.oracle_scales(x), err_msg=name)
    want, edge = q4.oracle_index(x, name)
    index = q4.oracle_unpack(codes, name)
    assert edge.mean() < 0.05
    np.testing.assert_array_equal(index[~edge], want[~edge], err_msg=name)
    assert (np.abs(index - want) <= 1).all()
    err = np.abs(q4.values_of(codes, scale, name, x.shape[1]) - x)
    assert (err <= q4.map_bound(x, name)).all(), name


def assert_nearest_8_bits(got, x, name):
    """8-bit rows `got` hold float32 values `x` written to nearest under map `name`: row
    scales and codes (ties aside) of tests/dtypes/test_quantized.py's oracle."""
    from dtypes import test_quantized as q8
    np.testing.assert_array_equal(got.scale.numpy(), np.abs(x).max(axis=1), err_msg=name)
    want, edge = q8.oracle_codes(x, name)
    codes = got.codes.numpy().astype(np.int64)
    assert edge.mean() < 0.05
    np.testing.assert_array_equal(codes[~edge], want[~edge], err_msg=name)
    assert (np.abs(codes - want) <= 1).all()


def test_int8_state_resumes_as_int4_and_back(tmp_path, data_root):
    """An int8-state AdamW run's step-3 checkpoint resumed with Optimizer.head_state_dtype=int4
    logs the conversion once; each moment's block scales are the largest magnitudes of the int8
    values and its codes the nearest 4-bit ones (tests/dtypes/test_quantized4.py's oracle),
    within that map's bound, and training goes on; that run's step-6 checkpoint resumed with
    int8 state logs the way back and holds the 4-bit values quantised to nearest int8 (the
    oracle of tests/dtypes/test_quantized.py) within a step of the map."""
    import plsc.checkpoint as ckpt
    from dtypes import test_quantized as q8, test_quantized4 as q4
    sections = dict(Loss={"param_dtype": "int8"}, Optimizer={"name": "adamw", "lr": 0.01})

    def run(name, state_dtype, **glob):
        return Trainer(config(data_root, str(tmp_path / name), Global=glob, Loss=sections["Loss"],
                              Optimizer=dict(sections["Optimizer"], head_state_dtype=state_dtype)),
                       backbone=make_backbone(1))

    def log_lines(name):
        text = open(os.path.join(str(tmp_path / name), "train.log")).read()
        return [line for line in text.splitlines() if "head optimizer state" in line]

    run("i8", None, max_steps=3).train()
    assert log_lines("i8") == []
    step3 = os.path.join(str(tmp_path / "i8"), "checkpoints", "step_00000003")
    as4 = run("i4", "int4", checkpoint=step3)
    assert as4.step == 3
    (line,) = log_lines("i4")
    assert line.endswith("head optimizer state: checkpoint has int8 (moment1, moment2), this "
                         "run stores int4: converted on load")
    for key, m8, m4 in (("moment1", "int8_log", "int4_log"), ("moment2", "uint8_log", "uint4_log")):
        rec = ckpt.load_head_rows(step3, f"opt.weight.{key}", 0, CLASSES)
        x = q8.value_of(rec["codes"], rec["scale"], m8).astype(np.float32)
        assert np.abs(x).max() > 0
        assert_nearest_4_bits(as4.head_opt.state_dict()[f"weight.{key}"], x, m4)
    history = as4.train()
    assert [s for s, _ in history] == [4, 5, 6] and np.isfinite([v for _, v in history]).all()
    step6 = os.path.join(str(tmp_path / "i4"), "checkpoints", "step_00000006")
    assert ckpt.read_meta(step6)["head_dtypes"]["opt.weight.moment2"] == "uint4_log"
    back = run("back", None, checkpoint=step6, max_steps=7)
    (line,) = log_lines("back")
    assert line.endswith("checkpoint has int4 (moment1, moment2), this run stores int8: "
                         "converted on load")
    for key, m4, m8 in (("moment1", "int4_log", "int8_log"), ("moment2", "uint4_log", "uint8_log")):
        a = as4.head_opt.state_dict()[f"weight.{key}"]
        x = q4.values_of(a.codes.numpy(), a.scale.numpy(), m4, a.shape[-1]).astype(np.float32)
        assert_nearest_8_bits(back.head_opt.state_dict()[f"weight.{key}"], x, m8)
    assert [s for s, _ in back.train()] == [7]
