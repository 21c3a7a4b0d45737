"""The transformer's residual add with drop path, x + branch·m (m one factor per sample, or
none), as one PyLayer of numpy passes on the CPU kernel set.

Paddle's way is a multiply by the per-sample mask and an add, two ops and two gradient nodes
(and neither is needed for the mask when there is none). `residual_add` computes the sum in
one or two numpy passes over a new tensor; its backward hands the output gradient on to x
unchanged and gives the branch that gradient times m. Under any other condition (not the CPU
kernel set, not float32, `to_static`) it is Paddle's multiply and add.
"""
import numpy as np
import paddle
from paddle.autograd import PyLayer

from ..cpu_kernels import applies, as_numpy

__all__ = ["residual_add", "takes_residual_path"]


def takes_residual_path(x, branch):
    """True when `residual_add` runs as the numpy PyLayer (see the module docstring)."""
    return (paddle.in_dynamic_mode() and applies(x, branch) and x.shape == branch.shape
            and x.ndim >= 1)


def _per_sample(factor, ndim):
    return factor.reshape((-1,) + (1,) * (ndim - 1))


class _ResidualAdd(PyLayer):
    @staticmethod
    def forward(ctx, x, branch, factor):
        out = paddle.empty(x.shape, dtype=x.dtype)
        y, b = as_numpy(out), as_numpy(branch)
        if factor is None:
            np.add(as_numpy(x), b, out=y)
        else:
            np.multiply(b, _per_sample(factor, b.ndim), out=y)
            np.add(as_numpy(x), y, out=y)
        ctx.factor = factor
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.factor is None:
            return grad, grad
        dbranch = paddle.empty(grad.shape, dtype=grad.dtype)
        g = as_numpy(grad)
        np.multiply(g, _per_sample(ctx.factor, g.ndim), out=as_numpy(dbranch))
        return grad, dbranch


def residual_add(x, branch, factor=None):
    """x + branch·m: `factor` m is a float32 numpy array of one value per sample (x's first
    axis), or None for x + branch (see the module docstring)."""
    if takes_residual_path(x, branch):
        return _ResidualAdd.apply(x, branch, factor)
    if factor is None:
        return x + branch
    m = paddle.to_tensor(_per_sample(np.asarray(factor, "float32"), branch.ndim),
                         place=branch.place)
    return x + branch * m.astype(branch.dtype)
