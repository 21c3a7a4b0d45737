"""AMP, as far as a CPU can show it (docs/training.md, "AMP: what only a GPU run shows").

Paddle 3.3's `auto_cast` turns itself off on the CPU (its level stays O0: nothing is cast), so
these tests check what does not need a GPU: which of a backbone's ops Paddle's O1 lists put in
16 bits, that the trainer runs its AMP branch with the backbone inside `auto_cast` and the
head outside it, and the float16 loss scaler's skip / halve / grow rules against a literal
re-implementation, with non-finite gradients injected into a real step.
"""
import contextlib
import math

import numpy as np
import paddle
import paddle.amp.amp_lists as amp_lists
import pytest
from paddle.base import core

from trainer_common import config, make_data
from plsc.process import runtime
from plsc.kernels.cpu_kernels import KERNELS_ENV
from plsc.models import build_model
from plsc.train import Trainer
from plsc.train import trainer as trainer_module
from plsc.train.amp import LossScaler


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("synthetic")))


def forward_ops(model, x):
    """{op type: calls} of one forward of `model` (Paddle's low-precision op statistics)."""
    def counts():
        return {op: sum(int(n) for n in str(calls).split(","))
                for op, calls in core.get_low_precision_op_list().items()}
    paddle.set_flags({"FLAGS_low_precision_op_list": 1})
    try:
        before = counts()  # (the statistics add up over the process)
        model(x)
        after = counts()
    finally:
        paddle.set_flags({"FLAGS_low_precision_op_list": 0})
    return {op: n - before.get(op, 0) for op, n in after.items() if n > before.get(op, 0)}


@pytest.mark.parametrize("name,size,expect_black", [
    ("IResNetTiny", 16, set()), ("MobileFaceNet", 112, set()),
    ("ViTDemo", 32, {"layer_norm", "softmax"})])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_which_backbone_ops_the_o1_lists_put_in_16_bits(monkeypatch, name, size, expect_black,
                                                        dtype):
    """Level O1: white-list ops run in `dtype` on a GPU, black-list ops in float32, the others
    in their inputs' dtype. Every op that multiplies matrices (conv2d, matmul_v2) is white;
    the black ones are the expected float32 islands (ViT's layer norm and softmax)."""
    monkeypatch.setenv(KERNELS_ENV, "device")  # Paddle's ops only, as on a GPU
    model = build_model(name, embedding_size=32, input_size=(size, size), dropout=0.0)
    model.train()
    ops = set(forward_ops(model, paddle.rand([2, 3, size, size])))
    white = amp_lists.white_list()[dtype]["O1"]
    black = amp_lists.black_list()[dtype]["O1"]
    gemms = {op for op in ops if op in ("conv2d", "matmul_v2", "matmul", "linear_v2", "mul")}
    assert gemms and gemms <= white, (gemms, ops)
    assert ops & black == expect_black, sorted(ops & black)


class _RecordingAutocast:
    """Stands in for `paddle.amp.auto_cast` in the trainer: records its arguments and whether
    the code runs inside it, then delegates to Paddle's."""

    def __init__(self):
        self.calls, self.inside = [], False

    @contextlib.contextmanager
    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        self.inside = True
        try:
            with _REAL_AUTO_CAST(**kwargs):
                yield
        finally:
            self.inside = False


_REAL_AUTO_CAST = paddle.amp.auto_cast


def amp_trainer(data_root, out, monkeypatch, dtype, **sections):
    """A trainer with AMP on, the device faked as a GPU (it runs on the CPU all the same)."""
    monkeypatch.setattr(runtime, "start", lambda cfg: "gpu:0")
    cfg = config(data_root, out, AMP={"enable": True, "dtype": dtype}, **sections)
    return Trainer(cfg)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_trainer_runs_the_backbone_inside_autocast_and_the_head_outside(
        tmp_path, data_root, monkeypatch, dtype):
    trainer = amp_trainer(data_root, str(tmp_path / "out"), monkeypatch, dtype,
                          Global={"max_steps": 3})
    assert trainer.scaler.enabled == (dtype == "float16")
    assert trainer.fused_head_update == (dtype == "bfloat16")  # a float16 step may be skipped
    cast = _RecordingAutocast()
    monkeypatch.setattr(trainer_module.paddle.amp, "auto_cast", cast)
    seen = {"backbone": [], "head": []}
    for part in ("backbone", "head"):
        layer = getattr(trainer, part)
        real = layer.forward

        def forward(*args, _real=real, _part=part, **kwargs):
            seen[_part].append(cast.inside)
            return _real(*args, **kwargs)
        layer.forward = forward
    history = trainer.train()
    assert [s for s, _ in history] == [1, 2, 3] and all(math.isfinite(v) for _, v in history)
    # each step: the trainer's autocast, and inside it the backbone's float32 embedding layers
    assert cast.calls == [{"enable": True, "dtype": dtype, "level": "O1"}, {"enable": False}] * 3
    assert seen == {"backbone": [True] * 3, "head": [False] * 3}


def scaler_oracle(pattern, scale, growth_interval, min_scale):
    """The float16 rules written out: a step with a non-finite gradient is skipped and halves
    the scale (not below `min_scale`); `growth_interval` good steps in a row double it. A
    skip counts towards divergence only when the scale it used was at the floor. Returns
    [(scale used, applied, skipped steps in a row that count)] a step."""
    out, good, run = [], 0, 0
    for bad in pattern:
        used = scale
        if bad:
            scale = max(scale / 2.0, min_scale)
            good = 0
            run = run + 1 if used <= min_scale else run
            out.append((used, False, run))
        else:
            good += 1
            if good == growth_interval:
                scale, good = scale * 2.0, 0
            run = 0
            out.append((used, True, run))
    return out


def test_loss_scaler_skips_halves_and_grows_like_the_rules(tmp_path, data_root, monkeypatch):
    """Non-finite values injected into one backbone gradient (inf, NaN) on chosen steps of a
    float16 AMP run: the scale used, the skipped steps (backbone and head untouched) and the
    divergence count follow `scaler_oracle` step by step."""
    pattern = [False, True, False, False, False, "nan", True, True, True, False, False, True]
    trainer = amp_trainer(data_root, str(tmp_path / "out"), monkeypatch, "float16",
                          Global={"max_nonfinite_steps": 100, "max_steps": 100})
    trainer.scaler = LossScaler(True, init_scale=8.0, growth_interval=2, min_scale=2.0)
    expected = scaler_oracle([bool(b) for b in pattern], 8.0, 2, 2.0)
    trainable = [p for p in trainer.backbone.parameters() if not p.stop_gradient]
    param = trainable[0]  # (BatchNorm's statistics, parameters too, move in every forward)
    inject = {"value": None}
    param.register_hook(lambda g: g * inject["value"] if inject["value"] is not None else g)
    rng = np.random.RandomState(3)
    for bad, (used, applied, run) in zip(pattern, expected):
        inject["value"] = {True: float("inf"), "nan": float("nan"), False: None}[bad]
        images = paddle.to_tensor(rng.normal(size=(4, 3, 16, 16)).astype("float32"))
        labels = paddle.to_tensor(rng.randint(0, 24, 4).astype("int64"))
        before = [p.numpy().copy() for p in trainable]
        head_before = trainer.head.weight.numpy().copy()
        assert trainer.scaler.scale == used
        trainer.train_step([(images, labels)])
        after = [p.numpy() for p in trainable]
        unchanged = all(np.array_equal(a, b) for a, b in zip(after, before))
        assert unchanged == (not applied), (bad, used, trainer.step)
        assert np.array_equal(trainer.head.weight.numpy(), head_before) == (not applied)
        assert trainer.nonfinite.run == run
    assert trainer.scaler.skipped == sum(1 for b in pattern if b)


class _Seen(Exception):
    """Raised by the embedding layer's pre-hook once it has recorded its input."""


def _embedding_layers(model):
    """(the layer whose output feeds the float32 part, its first layer, the embedding BN)."""
    if hasattr(model, "fc"):  # IResNet: bn2 -> flatten -> fc -> features
        return model.bn2, model.fc, model.features
    if hasattr(model, "conv_sep"):  # MobileFaceNet: layers -> conv_sep -> GDC(.., linear, BN)
        return model.layers, model.conv_sep, model.features.features
    return model.norm, model.feature[0], model.feature[3]  # ViT: norm -> feature head


@pytest.mark.parametrize("name,size", [("IResNetTiny", 16), ("MobileFaceNet", 112),
                                       ("ViTDemo", 32)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_embedding_layers_run_in_float32_under_autocast(monkeypatch, name, size, dtype):
    """arcface_torch computes the backbone's last fc and the embedding BatchNorm in float32
    under fp16 (IResNet's `self.fc(x.float() if self.fp16 else x)`, MobileFaceNet's conv_sep
    and GDC, the ViT's feature head outside autocast). On the CPU Paddle's auto_cast casts
    nothing and keeps its level at O0, so the 16-bit activations are made by a hook on the
    layer before, and the O1 level is set on the tracer by hand: the first float32 layer and
    the embedding BN must see float32 inputs with autocast off (level O0)."""
    monkeypatch.setenv(KERNELS_ENV, "device")  # Paddle's ops only, as on a GPU
    model = build_model(name, embedding_size=32, input_size=(size, size), dropout=0.0)
    model.train()
    before, first, bn = _embedding_layers(model)
    tracer = paddle.base.framework._dygraph_tracer()
    seen = {}

    def record(key, stop):
        def hook(_layer, inputs):
            seen[key] = (inputs[0].dtype, tracer._amp_level)
            if stop:
                raise _Seen
        return hook

    before.register_forward_post_hook(lambda _l, _i, out: out.astype(dtype))
    first.register_forward_pre_hook(record("first", False))
    bn.register_forward_pre_hook(record("bn", True))
    with paddle.amp.auto_cast(enable=True, dtype=dtype, level="O1"):
        state = tracer._amp_level, tracer._amp_dtype
        tracer._amp_level, tracer._amp_dtype = core.AmpLevel.O1, dtype  # as on a GPU
        try:
            with pytest.raises(_Seen):
                model(paddle.rand([2, 3, size, size]))
        finally:
            tracer._amp_level, tracer._amp_dtype = state
    assert seen == {"first": (paddle.float32, core.AmpLevel.O0),
                    "bn": (paddle.float32, core.AmpLevel.O0)}
