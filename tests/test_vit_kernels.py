"""The ViT's fused CPU pieces against independent oracles, on both kernel sets (each case checks
which path ran): `plsc.models.heads.split_heads` and `plsc.models.residual.residual_add`
against numpy float64, `plsc.models.linear_relu6.linear_relu6` against Paddle's autograd of
`F.relu6(F.linear(...))`, and oneDNN's clip (`plsc.kernels.onednn.eltwise`) against numpy."""
import plsc  # noqa: F401  -- before Paddle, for its CPU set-up
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from plsc.kernels import cpu_kernels, onednn
from plsc.kernels.cpu_kernels import as_numpy
from plsc.models.heads import split_heads, takes_heads_path
from plsc.models.linear_relu6 import linear_relu6, takes_linear_relu6_path
from plsc.models.residual import residual_add, takes_residual_path


def _leaf(array):
    t = paddle.to_tensor(np.asarray(array, "float32"))
    t.stop_gradient = False
    return t


def _close(got, want, name, rtol=1e-5):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(1.0, np.abs(want).max()),
                               err_msg=name)


@pytest.fixture(params=(1, 2))
def kernel_threads(request):
    """The CPU kernels on one and on two threads (the copies split by samples)."""
    before = cpu_kernels.threads()
    cpu_kernels.set_threads(request.param)
    yield request.param
    cpu_kernels.set_threads(before)


@pytest.mark.parametrize("batch,length,heads,d", [(3, 5, 2, 4), (1, 7, 8, 3), (5, 2, 1, 6)])
def test_split_heads_matches_numpy(batch, length, heads, d, kernels, kernel_threads):
    rng = np.random.RandomState(batch + length)
    scale = d ** -0.5
    qkv64 = rng.normal(0, 1, (batch, length, 3 * heads * d))
    qkv = _leaf(qkv64)
    assert takes_heads_path(qkv) == (kernels == "cpu")
    outs = split_heads(qkv, heads, scale)
    # oracle: columns q | k | v, each `heads` groups of d; [B, L, h, d] -> [B, h, L, d]
    parts = [qkv64[..., j * heads * d:(j + 1) * heads * d].reshape(batch, length, heads, d)
             .transpose(0, 2, 1, 3) for j in range(3)]
    want = [parts[0] * scale, parts[1], parts[2]]
    for name, got, w in zip("qkv", outs, want):
        assert got.shape == [batch, heads, length, d]
        assert got.is_contiguous() or kernels == "device"  # dense on the CPU set
        _close(got.numpy(), w, name)
    upstream = [rng.normal(0, 1, w.shape) for w in want]
    sum((t * paddle.to_tensor(u.astype("float32"))).sum() for t, u in zip(outs, upstream)) \
        .backward()
    grads = [upstream[0] * scale, upstream[1], upstream[2]]
    dqkv = np.concatenate([g.transpose(0, 2, 1, 3).reshape(batch, length, heads * d)
                           for g in grads], axis=-1)
    _close(qkv.grad.numpy(), dqkv, "dqkv")


def test_split_heads_gradient_of_unused_parts_is_zero():
    qkv = _leaf(np.random.RandomState(0).normal(0, 1, (2, 3, 12)))
    q, k, v = split_heads(qkv, 2, 0.5)
    (k * 2.0).sum().backward()
    grad = qkv.grad.numpy()
    np.testing.assert_array_equal(grad[..., 4:8], 2.0)
    np.testing.assert_array_equal(grad[..., :4], 0.0)
    np.testing.assert_array_equal(grad[..., 8:], 0.0)


@pytest.mark.parametrize("shape,bias", [((4, 6, 5), True), ((7, 5), False)])
def test_linear_relu6_matches_paddle(shape, bias, kernels):
    rng = np.random.RandomState(len(shape))
    x = _leaf(rng.normal(0, 3, shape))
    w = _leaf(rng.normal(0, 1, (5, 9)))
    b = _leaf(rng.normal(0, 1, (9,))) if bias else None
    assert takes_linear_relu6_path(x, w) == (kernels == "cpu")
    y = linear_relu6(x, w, b)
    upstream = paddle.to_tensor(rng.normal(0, 1, y.shape).astype("float32"))
    (y * upstream).sum().backward()
    leaves = [t for t in (x, w, b) if t is not None]
    got = [y.numpy()] + [t.grad.numpy() for t in leaves]
    copies = [_leaf(t.numpy()) for t in leaves]
    y2 = F.relu6(F.linear(copies[0], copies[1], copies[2] if bias else None))
    (y2 * upstream).sum().backward()
    want = [y2.numpy()] + [t.grad.numpy() for t in copies]
    assert (want[0] == 0).any() and (want[0] == 6).any()  # both ends clip
    for name, g, r in zip(["y", "dx", "dw", "db"], got, want):
        _close(g, r, name)


def test_linear_relu6_gradient_is_zero_at_both_ends():
    """ReLU6's gradient where the output is exactly 0 or 6 is 0 (Paddle's and torch's)."""
    x = _leaf([[-1.0], [0.0], [3.0], [6.0], [7.0]])
    w = _leaf([[1.0]])
    y = linear_relu6(x, w, None)
    y.sum().backward()
    np.testing.assert_array_equal(y.numpy().ravel(), [0, 0, 3, 6, 6])
    np.testing.assert_array_equal(x.grad.numpy().ravel(), [0, 0, 1, 0, 0])


@pytest.mark.skipif(not onednn.available(), reason="oneDNN not loaded")
def test_onednn_clip_forward_in_place_and_backward_from_output():
    from plsc.kernels.onednn.eltwise import clip_plan
    rng = np.random.RandomState(3)
    values = np.concatenate([rng.normal(0, 4, 997), [-2.0, 0.0, 1.0, 2.5, 3.0]])
    x = paddle.to_tensor(values.astype("float32"))
    dy = paddle.to_tensor(rng.normal(0, 1, values.shape).astype("float32"))
    dx = paddle.empty(x.shape, dtype="float32")
    plan = clip_plan(x.size, -2.0, 2.5)
    plan.forward(x.data_ptr(), x.data_ptr())
    y = np.clip(values.astype("float32"), -2.0, 2.5)
    np.testing.assert_array_equal(x.numpy(), y)
    plan.backward(x.data_ptr(), dy.data_ptr(), dx.data_ptr())
    np.testing.assert_array_equal(dx.numpy(), np.where((y > -2.0) & (y < 2.5), dy.numpy(), 0))
    assert clip_plan(x.size, -2.0, 2.5) is plan


@pytest.mark.parametrize("with_factor", [False, True])
def test_residual_add_matches_numpy(with_factor, kernels):
    rng = np.random.RandomState(4)
    x64, b64 = rng.normal(0, 1, (4, 3, 5)), rng.normal(0, 1, (4, 3, 5))
    x, branch = _leaf(x64), _leaf(b64)
    factor = np.array([0.0, 1.25, 1.25, 0.0], "float32") if with_factor else None
    assert takes_residual_path(x, branch) == (kernels == "cpu")
    out = residual_add(x, branch, factor)
    m = np.ones(4) if factor is None else factor.astype("float64")
    _close(out.numpy(), x64 + b64 * m[:, None, None], "out")
    upstream = rng.normal(0, 1, out.shape)
    (out * paddle.to_tensor(upstream.astype("float32"))).sum().backward()
    _close(x.grad.numpy(), upstream, "dx")
    _close(branch.grad.numpy(), upstream * m[:, None, None], "dbranch")


def test_residual_add_output_is_new_memory():
    x, branch = _leaf(np.ones((2, 3))), _leaf(np.ones((2, 3)))
    out = residual_add(x, branch)
    as_numpy(out)[...] = 7.0
    np.testing.assert_array_equal(x.numpy(), 1.0)
    np.testing.assert_array_equal(branch.numpy(), 1.0)


def test_block_training_step_is_the_same_on_both_sets(monkeypatch):
    """A ViT block in training (drop path 0.5: the branches of some samples dropped, of others
    scaled) on the CPU set against the device set (Paddle's ops): the same draws from Paddle's
    generator, the same output and gradients."""
    from plsc.models.vit import Block
    paddle.seed(5)
    block = Block(16, 2, drop_path=0.5)
    block.train()
    x64 = np.random.RandomState(6).normal(0, 1, (8, 5, 16))
    seed = 7
    paddle.seed(seed)
    draws = paddle.rand([2, 8]).numpy()  # the block's two draws of [8, 1, 1]
    assert (draws < 0.5).any() and (draws >= 0.5).any()
    results = []
    for kernel_set in ("auto", "device"):
        monkeypatch.setenv(cpu_kernels.KERNELS_ENV, kernel_set)
        x = _leaf(x64)
        paddle.seed(seed)
        out = block(x)
        (out * out).sum().backward()
        grads = {n: p.grad.numpy() for n, p in block.named_parameters()}
        results.append((out.numpy(), x.grad.numpy(), grads))
        block.clear_gradients(set_to_zero=False)
    (out_cpu, dx_cpu, g_cpu), (out_dev, dx_dev, g_dev) = results
    _close(out_cpu, out_dev, "out", rtol=1e-4)
    _close(dx_cpu, dx_dev, "dx", rtol=1e-4)
    for name in g_dev:
        _close(g_cpu[name], g_dev[name], name, rtol=1e-4)


def test_add_to_every_sample_matches_numpy(kernels):
    from plsc.models.residual import add_to_every_sample
    rng = np.random.RandomState(8)
    x64, p64 = rng.normal(0, 1, (5, 4, 3)), rng.normal(0, 1, (1, 4, 3))
    x, p = _leaf(x64), _leaf(p64)
    out = add_to_every_sample(x, p)
    _close(out.numpy(), x64 + p64, "out")
    upstream = rng.normal(0, 1, out.shape)
    (out * paddle.to_tensor(upstream.astype("float32"))).sum().backward()
    _close(x.grad.numpy(), upstream, "dx")
    _close(p.grad.numpy(), upstream.sum(0, keepdims=True), "dp")


@pytest.mark.parametrize("picked", [3, 6])
def test_take_rows_per_sample_matches_numpy(picked, kernels):
    """A part of a permutation (masking's kept tokens) and a whole one (its undoing)."""
    from plsc.models.gather import take_rows_per_sample
    rng = np.random.RandomState(picked)
    x64 = rng.normal(0, 1, (4, 6, 5))
    ids64 = np.stack([rng.permutation(6)[:picked] for _ in range(4)])
    x = _leaf(x64)
    out = take_rows_per_sample(x, paddle.to_tensor(ids64))
    want = np.stack([x64[b, ids64[b]] for b in range(4)])
    _close(out.numpy(), want, "out")
    upstream = rng.normal(0, 1, want.shape)
    (out * paddle.to_tensor(upstream.astype("float32"))).sum().backward()
    dx = np.zeros_like(x64)
    for b in range(4):
        dx[b, ids64[b]] = upstream[b]
    _close(x.grad.numpy(), dx, "dx")
