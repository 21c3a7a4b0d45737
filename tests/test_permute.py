"""plsc.models.permute.permute against Paddle's transpose: values, density and gradient."""
import numpy as np
import paddle
import pytest

from plsc.models.permute import permute


@pytest.mark.parametrize("shape,perm", [((2, 3, 4, 5, 6), (2, 0, 3, 1, 4)),
                                        ((4, 5, 6, 7), (0, 2, 1, 3)), ((3, 8, 9), (0, 2, 1))])
def test_matches_transpose(shape, perm, kernels):
    paddle.seed(2)
    x = paddle.randn(list(shape))
    x.stop_gradient = False
    y = permute(x, perm)
    assert y.is_contiguous()
    np.testing.assert_array_equal(y.numpy(), np.transpose(x.numpy(), perm))
    upstream = paddle.randn(y.shape)
    (y * upstream).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(),
                                  np.transpose(upstream.numpy(), np.argsort(perm)))


def test_strided_input():
    x = paddle.randn([4, 6, 5]).transpose([1, 0, 2])
    np.testing.assert_array_equal(permute(x, [2, 1, 0]).numpy(),
                                  np.transpose(x.numpy(), [2, 1, 0]))
