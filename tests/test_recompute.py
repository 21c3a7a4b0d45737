"""`Model.recompute`: each block's activations recomputed in the backward. The oracle is the same
model run without recompute (no recompute code on its path): losses, gradients, BatchNorm
running statistics and the random generator's state must be equal bit for bit after steps with
an optimizer. A plain recompute (statistics updated again in the re-run) is shown to fail the
same comparison, so the check can tell."""
import contextlib

import numpy as np
import paddle
import pytest

import plsc.models.recompute as rc
from plsc.models import build_model

SIZE = (32, 32)


def _train(name, recompute, steps=2, size=SIZE, **kw):
    """Losses, last gradients, final state and the generator's next draw after `steps` SGD
    steps."""
    paddle.seed(7)
    model = build_model(name, embedding_size=16, input_size=size, recompute=recompute, **kw)
    model.train()
    opt = paddle.optimizer.Momentum(0.05, momentum=0.9, parameters=model.parameters())
    losses = []
    for i in range(steps):
        x = paddle.to_tensor(np.random.RandomState(i).standard_normal((4, 3) + size)
                             .astype("float32"))
        emb = model(x)
        loss = (emb * emb).sum()
        loss.backward()
        grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()
                 if p.grad is not None}
        opt.step()
        opt.clear_grad(set_to_zero=False)
        losses.append(loss.numpy().copy())
    state = {n: t.numpy().copy() for n, t in model.state_dict().items()}
    return losses, grads, state, paddle.rand([4]).numpy()


def _assert_same(a, b):
    assert all(np.array_equal(x, y) for x, y in zip(a[0], b[0])), "losses differ"
    assert a[1].keys() == b[1].keys() and len(a[1]) > 10
    for name in a[1]:
        assert np.array_equal(a[1][name], b[1][name]), f"gradient of {name} differs"
    for name in a[2]:
        assert np.array_equal(a[2][name], b[2][name]), f"{name} differs"
    assert np.array_equal(a[3], b[3]), "the random generator ended elsewhere"


def _stats(state):
    return {n: v for n, v in state.items() if n.endswith(("_mean", "_variance"))}


def test_iresnet_recompute_equals_plain_run():
    plain = _train("IResNetTiny", False)
    _assert_same(plain, _train("IResNetTiny", True))
    assert len(_stats(plain[2])) >= 20  # the blocks' BatchNorms are compared


def test_vit_recompute_equals_plain_run():
    """Drop path inside the blocks draws again in the re-run: the same draws (the generator's
    state is restored for it and left where the forward left it); masking and the feature
    head's BatchNorms are outside the blocks."""
    kw = dict(size=(28, 28), drop_path_rate=0.5, mask_ratio=0.25, dropout=0.1)
    plain = _train("ViTDemo", False, **kw)
    _assert_same(plain, _train("ViTDemo", True, **kw))
    other = _train("ViTDemo", False, **dict(kw, drop_path_rate=0.0))
    assert not np.array_equal(plain[0][0], other[0][0])  # drop path acts on the compared loss


def test_plain_recompute_would_update_statistics_twice(monkeypatch):
    """Without putting the statistics back, the re-run moves them again: losses and gradients
    still agree, the running statistics do not (the flaw plsc avoids)."""
    monkeypatch.setattr(rc, "_statistics_kept", lambda layer: contextlib.nullcontext())
    plain, twice = _train("IResNetTiny", False), _train("IResNetTiny", True)
    assert all(np.array_equal(x, y) for x, y in zip(plain[0][:1], twice[0][:1]))
    differ = {n for n, v in _stats(plain[2]).items() if not np.array_equal(v, twice[2][n])}
    assert {"bn1._mean", "layer1.0.bn1._mean", "layer4.0.bn3._variance"} <= differ
    assert not differ & {"bn2._mean", "bn2._variance", "features.norm._mean"}  # not recomputed


def test_no_recompute_outside_training():
    """In eval mode and under no_grad the blocks run as they are (nothing to recompute)."""
    paddle.seed(3)
    model = build_model("IResNetTiny", embedding_size=16, input_size=SIZE, recompute=True)
    x = paddle.randn([2, 3, *SIZE])
    calls = []
    original = rc.run_blocks

    def spy(blocks, x, recompute=False):
        calls.append(recompute and paddle.is_grad_enabled())
        return original(blocks, x, recompute)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("plsc.models.iresnet.run_blocks", spy)
        model.eval()
        with paddle.no_grad():
            model(x)
        model.train()
        with paddle.no_grad():
            model(x)
    assert calls and not any(calls)


def test_model_recompute_key():
    """`Model.recompute`: null keeps the name's (arcface_torch checkpoints ViT-B/L/H), a value
    overrides it, and a backbone without blocks to recompute refuses it by name."""
    from plsc.config import ConfigError, validate
    from plsc.parts import build_backbone

    def cfg(name, value):
        return validate({"Model": {"name": name, "recompute": value, "embedding_size": 8},
                         "Loss": {"num_classes": 2}, "Data": {"root": "x", "image_size": [28, 28]}})
    with paddle.LazyGuard():
        assert build_backbone(cfg("vit_b", None)).recompute is True
        assert build_backbone(cfg("vit_b", False)).recompute is False
        assert build_backbone(cfg("vit_t", None)).recompute is False
    assert build_backbone(cfg("IResNetTiny", True)).recompute is True
    with pytest.raises(ConfigError, match="Model.recompute=True: MobileFaceNet has no recompute"):
        build_backbone(cfg("MobileFaceNet", True))
