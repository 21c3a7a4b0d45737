"""plsc.models.linear.Linear (GEMMs only on the CPU kernel set) against paddle.nn.Linear.

The oracle is Paddle's own `nn.functional.linear` and its autograd gradients; each case also
checks which path ran."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from plsc.models.linear import Linear, takes_gemm_path


@pytest.mark.parametrize("shape,bias", [((7, 5), True), ((3, 11, 5), True), ((2, 3, 4, 5), False),
                                        ((6, 5), False)])
def test_matches_paddle_linear(shape, bias, kernels):
    paddle.seed(11)
    layer = Linear(5, 9, bias_attr=None if bias else False)
    x = paddle.randn(list(shape))
    x.stop_gradient = False
    assert takes_gemm_path(x, layer.weight) == (kernels == "cpu")
    y = layer(x)
    upstream = paddle.randn(y.shape)
    (y * upstream).sum().backward()
    got = [y.numpy(), x.grad.numpy(), layer.weight.grad.numpy()]
    got += [layer.bias.grad.numpy()] if bias else []
    x2, w2 = x.detach(), layer.weight.detach()
    x2.stop_gradient = w2.stop_gradient = False
    b2 = None
    if bias:
        b2 = layer.bias.detach()
        b2.stop_gradient = False
    y2 = F.linear(x2, w2, b2)
    (y2 * upstream).sum().backward()
    want = [y2.numpy(), x2.grad.numpy(), w2.grad.numpy()] + ([b2.grad.numpy()] if bias else [])
    for name, g, r in zip(["y", "dx", "dw", "db"], got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=name)


def test_frozen_parts_get_no_gradient():
    layer = Linear(4, 3)
    layer.bias.stop_gradient = True
    x = paddle.randn([5, 4])
    layer(x).sum().backward()
    assert x.grad is None and layer.bias.grad is None
    np.testing.assert_allclose(layer.weight.grad.numpy(),
                               np.repeat(x.numpy().sum(0, keepdims=True).T, 3, axis=1),
                               rtol=1e-5, atol=1e-5)
