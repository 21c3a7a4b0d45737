"""Activations kept blocked (nChw16c or nChw8c, `plsc.models.blocked`): each layer that takes
them against an oracle on the plain layout (float64 numpy for BatchNorm and PReLU, Paddle's
conv2d and its autograd for the convolution), and IResNet's blocked run against its own plain
run. The block is oneDNN's own choice (16 on AVX-512, 8 on AVX2): the whole module runs again in
one process under ``ONEDNN_MAX_CPU_ISA=AVX2`` (`test_the_module_under_the_avx2_cap`)."""
import os
import subprocess
import sys

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from plsc.kernels import onednn
from plsc.models import IResNet, blocked, iresnet
from plsc.models.batchnorm import BatchNorm2D
from plsc.models.conv import Conv2D
from plsc.models import prelu as prelu_module
from plsc.models.prelu import prelu

EPS = 1e-5
CAP = "ONEDNN_MAX_CPU_ISA"


def _to_blocked(a):
    """Plain [N, C, H, W] as [N, C/B, H, W, B], B the block in use."""
    n, c, h, w = a.shape
    size = blocked.block()
    return np.ascontiguousarray(a.reshape(n, c // size, size, h, w).transpose(0, 1, 3, 4, 2))


def _to_plain(b):
    n, cb, h, w, size = b.shape
    return b.transpose(0, 1, 4, 2, 3).reshape(n, cb * size, h, w)


def _avx512_core():
    """True when this CPU has the AVX-512 subsets oneDNN's avx512_core kernels need."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(flags)


def test_block_is_onednns_own_choice():
    """16 channels where oneDNN runs its AVX-512 kernels, 8 under an AVX2 cap (or CPU)."""
    if not onednn.available():
        pytest.skip("no oneDNN")
    capped = os.environ.get(CAP, "").upper() == "AVX2"
    if not (capped or _avx512_core()):
        pytest.skip("neither AVX-512 nor the AVX2 cap: no expectation")
    assert (blocked.block(), onednn.blocked_native()) == ((8 if capped else 16), True)


def test_the_module_under_the_avx2_cap():
    """This module again in a process whose oneDNN is capped at AVX2 (read when it loads):
    every layer and IResNet on the 8-channel block."""
    if os.environ.get(CAP) or not _avx512_core():
        pytest.skip("already capped, or no AVX-512 to cap: this process ran the 8-channel block")
    env = dict(os.environ, **{CAP: "AVX2"})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           os.path.abspath(__file__)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " failed" not in proc.stdout and " passed" in proc.stdout


def _close(got, want, rel, name=""):
    scale = max(1e-30, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * scale, err_msg=name)


def test_layout_round_trip_and_bad_channels():
    x = np.random.default_rng(0).standard_normal((2, 32, 3, 5)).astype(np.float32)
    size = blocked.block()
    b = blocked.to_blocked(paddle.to_tensor(x))
    assert b.shape == [2, 32 // size, 3, 5, size] and blocked.is_blocked(b)
    assert np.array_equal(b.numpy(), _to_blocked(x))
    assert blocked.logical_shape(b) == [2, 32, 3, 5]
    assert np.array_equal(blocked.to_plain(b).numpy(), x)
    bad = size + size // 2
    with pytest.raises(ValueError, match=f"multiples of {size}, got {bad}"):
        blocked.to_blocked(paddle.zeros([1, bad, 2, 2]))


def _batch_norm64(x, w, b, g):
    """Training batch norm and its gradients in float64 (biased batch variance)."""
    x, g = x.astype(np.float64), g.astype(np.float64)
    axes = (0, 2, 3)
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    c = lambda v: v.reshape(1, -1, 1, 1)  # noqa: E731
    xhat = (x - c(mean)) / c(np.sqrt(var + EPS))
    dx = c(w / np.sqrt(var + EPS)) * (g - c(g.mean(axis=axes))
                                      - xhat * c((g * xhat).mean(axis=axes)))
    return xhat * c(w) + c(b), dx, (g * xhat).sum(axis=axes), g.sum(axis=axes), mean, var


@pytest.mark.parametrize("unbiased", [True, False])
def test_batch_norm_on_blocked_data_matches_float64(unbiased):
    rng = np.random.default_rng(1)
    shape = (4, 32, 5, 6)
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    layer = BatchNorm2D(32, epsilon=EPS)
    layer.unbiased_var = unbiased
    w, b = rng.uniform(0.5, 1.5, 32).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    layer.weight.set_value(w)
    layer.bias.set_value(b)
    xb = paddle.to_tensor(_to_blocked(x), stop_gradient=False)
    y = layer(xb)
    size = blocked.block()
    assert y.shape == [4, 32 // size, 5, 6, size]
    assert (shape, EPS, size) in onednn.batchnorm._plans  # oneDNN's kernel ran
    y.backward(paddle.to_tensor(_to_blocked(g)))
    want_y, want_dx, want_dw, want_db, mean, var = _batch_norm64(x, w, b, g)
    _close(_to_plain(y.numpy()), want_y, 1e-5, "y")
    _close(_to_plain(xb.grad.numpy()), want_dx, 1e-5, "dx")
    _close(layer.weight.grad.numpy(), want_dw, 1e-5, "dw")
    _close(layer.bias.grad.numpy(), want_db, 1e-5, "db")
    n = shape[0] * shape[2] * shape[3]
    run_var = 0.9 + 0.1 * (var * n / (n - 1) if unbiased else var)  # from 1, momentum 0.1
    _close(layer._mean.numpy(), 0.1 * mean, 1e-6, "running mean")
    _close(layer._variance.numpy(), run_var, 1e-6, "running var")
    other = 0.9 + 0.1 * (var if unbiased else var * n / (n - 1))
    assert np.abs(other - run_var).max() > 100 * 1e-6 * np.abs(run_var).max()
    layer.eval()
    c = lambda v: v.reshape(1, -1, 1, 1).astype(np.float64)  # noqa: E731
    want_e = (x - c(layer._mean.numpy())) / np.sqrt(c(layer._variance.numpy()) + EPS) * c(w) + c(b)
    with paddle.no_grad():  # oneDNN's inference kernel
        e = layer(paddle.to_tensor(_to_blocked(x)))
    _close(_to_plain(e.numpy()), want_e, 1e-5, "eval")
    xe = paddle.to_tensor(_to_blocked(x), stop_gradient=False)  # with gradients: Paddle's
    e = layer(xe)
    _close(_to_plain(e.numpy()), want_e, 1e-5, "eval with gradients")
    e.backward(paddle.to_tensor(_to_blocked(g)))
    _close(_to_plain(xe.grad.numpy()), c(w) / np.sqrt(c(layer._variance.numpy()) + EPS) * g,
           1e-5, "eval dx")


@pytest.mark.parametrize("slopes", [32, 1, "outside"])
def test_prelu_on_blocked_data_matches_float64_and_paddle(slopes, monkeypatch):
    plans = []
    real_plan = prelu_module.onednn.prelu_plan
    monkeypatch.setattr(prelu_module.onednn, "prelu_plan",
                        lambda *args: plans.append(args) or real_plan(*args))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 32, 4, 5)).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    a = rng.uniform(0, 1, 1 if slopes == 1 else 32).astype(np.float32)
    if slopes == "outside":
        a[3], a[4] = 1.5, -0.5  # oneDNN's kernels take any slope
    xb = paddle.to_tensor(_to_blocked(x), stop_gradient=False)
    ab = paddle.to_tensor(a, stop_gradient=False)
    y = prelu(xb, ab)
    assert y.shape == [3, 32 // blocked.block(), 4, 5, blocked.block()]
    assert plans == [([3, 32, 4, 5], a.size, blocked.block())]  # oneDNN's, on the blocks
    y.backward(paddle.to_tensor(_to_blocked(g)))
    xp = paddle.to_tensor(x, stop_gradient=False)
    ap = paddle.to_tensor(a, stop_gradient=False)
    yp = F.prelu(xp, ap)
    yp.backward(paddle.to_tensor(g))
    assert np.array_equal(_to_plain(y.numpy()), yp.numpy())  # bit for bit, as on plain data
    assert np.array_equal(_to_plain(xb.grad.numpy()), xp.grad.numpy())
    slope = a.astype(np.float64).reshape(1, -1, 1, 1) if a.size > 1 else float(a[0])
    contrib = np.where(x > 0, 0.0, g.astype(np.float64) * x)
    da = contrib.sum(axis=(0, 2, 3)) if a.size > 1 else contrib.sum(keepdims=True).reshape(1)
    np.testing.assert_allclose(ab.grad.numpy(), da, rtol=2e-5, atol=1e-4)
    assert np.array_equal(_to_plain(y.numpy()), np.where(x > 0, x, slope * x).astype(np.float32))


# in, out, kernel, stride, bias, blocked input (else a plain input asked for a blocked output)
CONVS = [(3, 16, 3, 1, False, False), (16, 32, 3, 2, False, True), (32, 32, 1, 2, True, True),
         (32, 16, 3, 1, False, True), (16, 24, 3, 1, False, True),  # blocked in 8s, plain in 16s
         (16, 20, 3, 1, False, True)]  # a plain output


@pytest.mark.parametrize("case", CONVS)
def test_conv_on_blocked_data_matches_paddle_conv2d(case, monkeypatch):
    if not onednn.blocked_native():
        pytest.skip("oneDNN does not choose the blocked layout on this CPU")
    cin, cout, k, stride, bias, blocked_in = case
    paddle.seed(3)
    conv = Conv2D(cin, cout, k, stride=stride, padding=k // 2, bias_attr=None if bias else False)
    conv.emit_blocked = True
    x = np.random.default_rng(4).standard_normal((3, cin, 10, 9)).astype(np.float32)
    xt = paddle.to_tensor(_to_blocked(x) if blocked_in else x, stop_gradient=False)
    y = conv(xt)
    out_blocked = cout % blocked.block() == 0
    assert blocked.is_blocked(y) == out_blocked
    shape = blocked.logical_shape(y) if out_blocked else y.shape
    g = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    y.backward(paddle.to_tensor(_to_blocked(g) if out_blocked else g))
    xp = paddle.to_tensor(x, stop_gradient=False)
    wp = conv.weight.detach()
    wp.stop_gradient = False
    bp = conv.bias.detach() if bias else None
    if bias:
        bp.stop_gradient = False
    yp = F.conv2d(xp, wp, bp, stride=stride, padding=k // 2)
    yp.backward(paddle.to_tensor(g))
    _close(_to_plain(y.numpy()) if out_blocked else y.numpy(), yp.numpy(), 2e-5, "y")
    dx = xt.grad.numpy()
    _close(_to_plain(dx) if blocked_in else dx, xp.grad.numpy(), 2e-5, "dx")
    _close(conv.weight.grad.numpy(), wp.grad.numpy(), 2e-5, "dw")
    if bias:
        _close(conv.bias.grad.numpy(), bp.grad.numpy(), 2e-5, "db")
    # without gradients, in pieces of one sample where the input is staged: the same values
    monkeypatch.setattr(onednn.conv, "CALL_BYTES", 1)
    with paddle.no_grad():
        y_ng = conv(xt.detach())
    assert np.array_equal(y_ng.numpy(), y.numpy())


def _train_and_eval(model, x, r):
    model.train()
    y = model(x)
    (y * r).sum().backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.clear_gradient(False)
    stats = {n: v.numpy() for n, v in model.state_dict().items()
             if n.endswith("_mean") or n.endswith("_variance")}
    model.eval()
    with paddle.no_grad():
        e = model(x).numpy()
    return y.numpy(), grads, stats, e


@pytest.mark.parametrize("widths", [(64, 64, 128, 128), (16, 32, 64, 128)])
def test_iresnet_keeps_activations_blocked_and_equals_its_plain_run(kernels, widths):
    """Blocked where the stem is wide enough (`test_narrow_stems_stay_plain`): IResNetTiny's
    widths too, in either block."""
    paddle.seed(6)
    model = IResNet((1, 1, 1, 1), widths=widths, input_size=(32, 32), embedding_size=32)
    seen = []
    model.layer2[0].register_forward_post_hook(
        lambda layer, inputs, out: seen.append(out.shape[4] if out.ndim == 5 else 0))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    x = paddle.to_tensor(np.random.default_rng(7).standard_normal((4, 3, 32, 32)).astype("float32"))
    r = paddle.to_tensor(np.random.default_rng(8).standard_normal((4, 32)).astype("float32"))
    got = _train_and_eval(model, x, r)
    native = (kernels == "cpu" and onednn.blocked_native()
              and widths[0] >= iresnet.BLOCKED_FROM_WIDTH)
    size = blocked.block()  # blocked in its blocks, for the training and the evaluation forward
    assert seen == ([size, size] if native else [0, 0])
    if not native:
        return
    model.set_state_dict(start)
    model.conv1.emit_blocked = False  # the plain oneDNN run
    want = _train_and_eval(model, x, r)
    assert seen[2:] == [0, 0]
    _close(got[0], want[0], 1e-5, "embeddings")
    assert got[1].keys() == want[1].keys()
    # a bias that a BatchNorm follows has a gradient of 0 up to rounding: an absolute floor
    floor = 1e-5 * max(float(np.abs(g).max()) for g in want[1].values())
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=0,
                                   atol=2e-3 * np.abs(want[1][name]).max() + floor, err_msg=name)
    for name in want[2]:
        np.testing.assert_allclose(got[2][name], want[2][name], rtol=0,
                                   atol=1e-5 * np.sqrt(np.abs(want[2][name]).max()) + 1e-7,
                                   err_msg=name)
    _close(got[3], want[3], 1e-5, "evaluation")


@pytest.mark.parametrize("size", [16, 8])
def test_narrow_stems_stay_plain(size):
    """In 16- and 8-channel blocks alike, from a stem of 16 channels on: IResNetTiny is
    blocked, a stem of 8 is not (the threshold is docs/performance.md's measurement, written
    here)."""
    if not onednn.available():
        pytest.skip("no oneDNN")
    onednn.force_block(size)
    try:
        for widths, want in (((16, 32, 64, 128), True), ((8, 16, 32, 64), False)):
            model = IResNet((1, 1, 1, 1), widths=widths, input_size=(32, 32), embedding_size=32)
            seen = []
            model.layer2[0].register_forward_post_hook(
                lambda layer, inputs, out: seen.append(out.ndim))
            model(paddle.randn([2, 3, 32, 32]))
            assert (model.conv1.emit_blocked, seen) == (want, [5 if want else 4]), widths
    finally:
        onednn.force_block(None)


@pytest.fixture
def other_block():
    """The block oneDNN did not choose, forced for the test (`onednn.force_block`), then
    oneDNN's own choice again."""
    if not onednn.available():
        pytest.skip("no oneDNN")
    native = blocked.block()
    onednn.force_block(24 - native)  # 8 <-> 16
    yield 24 - native
    onednn.force_block(None)
    assert blocked.block() == native


def test_a_forced_block_is_followed_and_planned_apart(other_block):
    """The block forced on this CPU: the layout, a convolution (against Paddle's conv2d) and a
    BatchNorm (float64) take it, in plans of their own beside the native block's."""
    assert blocked.block() == other_block and onednn.blocked_native()
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 16, 6, 7)).astype(np.float32)
    xb = blocked.to_blocked(paddle.to_tensor(x))
    assert xb.shape == [2, 16 // other_block, 6, 7, other_block]
    assert np.array_equal(xb.numpy(), _to_blocked(x))
    paddle.seed(10)
    conv = Conv2D(16, 32, 3, padding=1, bias_attr=False)
    y = conv(xb)
    assert blocked.is_blocked(y)
    _close(_to_plain(y.numpy()), F.conv2d(paddle.to_tensor(x), conv.weight, padding=1).numpy(),
           2e-5, "conv")
    geometry = ((2, 16, 6, 7), (32, 16, 3, 3), (1, 1), (1, 1), (1, 1), (1, 1), 1, False, True,
                True)
    forced = onednn.plan(*geometry)
    onednn.force_block(None)
    assert onednn.plan(*geometry) is not forced  # the native block's own plan
    onednn.force_block(other_block)
    layer = BatchNorm2D(16, epsilon=EPS)
    out = layer(xb)
    assert ((2, 16, 6, 7), EPS, other_block) in onednn.batchnorm._plans
    ones, zeros = np.ones(16), np.zeros(16)
    _close(_to_plain(out.numpy()), _batch_norm64(x, ones, zeros, x)[0], 1e-5, "batch norm")
