"""plsc.models.rows (oneDNN softmax and LayerNorm on the CPU kernel set) against Paddle's own
softmax and layer_norm and their autograd gradients; each case checks which path ran."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from plsc.models.rows import LayerNorm, softmax_last, takes_onednn_rows

pytestmark = pytest.mark.usefixtures("kernels")


def _close(got, want, name):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max()),
                               err_msg=name)


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 4, 33), (1, 129)])
def test_softmax_matches_paddle(shape, kernels):
    paddle.seed(1)
    x = paddle.randn(list(shape)) * 4
    x.stop_gradient = False
    assert takes_onednn_rows(x) == (kernels == "cpu")
    y = softmax_last(x)
    g = paddle.randn(y.shape)
    (y * g).sum().backward()
    x2 = x.detach()
    x2.stop_gradient = False
    y2 = F.softmax(x2, axis=-1)
    (y2 * g).sum().backward()
    _close(y.numpy(), y2.numpy(), "y")
    _close(x.grad.numpy(), x2.grad.numpy(), "dx")


@pytest.mark.parametrize("shape,eps", [((6, 16), 1e-5), ((2, 9, 40), 1e-6), ((3, 1, 8), 1e-3)])
def test_layer_norm_matches_paddle(shape, eps, kernels):
    paddle.seed(2)
    width = shape[-1]
    norm = LayerNorm(width, epsilon=eps)
    with paddle.no_grad():  # not the identity, so the parameters' roles show
        norm.weight.set_value(paddle.randn([width]))
        norm.bias.set_value(paddle.randn([width]))
    x = paddle.randn(list(shape)) * 3 + 1
    x.stop_gradient = False
    assert takes_onednn_rows(x, norm.weight) == (kernels == "cpu")
    y = norm(x)
    g = paddle.randn(y.shape)
    (y * g).sum().backward()
    x2, w2, b2 = x.detach(), norm.weight.detach(), norm.bias.detach()
    for t in (x2, w2, b2):
        t.stop_gradient = False
    y2 = F.layer_norm(x2, width, w2, b2, epsilon=eps)
    (y2 * g).sum().backward()
    _close(y.numpy(), y2.numpy(), "y")
    _close(x.grad.numpy(), x2.grad.numpy(), "dx")
    _close(norm.weight.grad.numpy(), w2.grad.numpy(), "dw")
    _close(norm.bias.grad.numpy(), b2.grad.numpy(), "db")


def test_layer_norm_frozen_input_and_strided_rows():
    norm = LayerNorm(8)
    x = paddle.randn([8, 5]).transpose([1, 0])  # strided
    assert not x.is_contiguous()
    y = norm(x)
    _close(y.numpy(), F.layer_norm(x.contiguous(), 8, norm.weight, norm.bias).numpy(), "y")
    y.sum().backward()
    assert x.grad is None and norm.weight.grad is not None
    xs = paddle.randn([8, 5]).transpose([1, 0])
    xs.stop_gradient = False
    g = paddle.randn([5, 8])
    (norm(xs) * g).sum().backward()  # a strided input that needs its gradient gets it
    xr = xs.detach().contiguous()
    xr.stop_gradient = False
    (F.layer_norm(xr, 8, norm.weight.detach(), norm.bias.detach()) * g).sum().backward()
    _close(xs.grad.numpy(), xr.grad.numpy(), "dx")


def test_softmax_backward_without_a_jit_kernel(kernels, monkeypatch):
    """Below AVX-512 oneDNN's softmax backward is its reference kernel; the layer then takes
    numpy's (cpu_kernels.softmax_grad): its gradient against float64's y·(g − Σ y·g), over
    rows in several slabs."""
    if kernels != "cpu":
        pytest.skip("the CPU kernel set's path")
    from plsc.kernels.onednn import rows as onednn_rows

    def no_onednn_backward(*args):
        raise AssertionError("oneDNN's backward ran")
    monkeypatch.setattr(onednn_rows._Softmax, "backward_is_reference", lambda self: True)
    monkeypatch.setattr(onednn_rows._Softmax, "backward", no_onednn_backward)
    rng = np.random.default_rng(3)
    xs = (rng.standard_normal((4, 300, 144)) * 4).astype(np.float32)
    gs = rng.standard_normal(xs.shape).astype(np.float32)
    x = paddle.to_tensor(xs, stop_gradient=False)
    softmax_last(x).backward(paddle.to_tensor(gs))
    e = np.exp(xs.astype(np.float64) - xs.max(-1, keepdims=True))
    y = e / e.sum(-1, keepdims=True)
    want = y * (gs - (y * gs).sum(-1, keepdims=True))
    _close(x.grad.numpy(), want, "dx")
