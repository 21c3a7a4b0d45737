"""The transformer's adds as PyLayers of numpy passes on the CPU kernel set: the residual add
with drop path, x + branch·m (m one factor per sample, or none), and the position
embedding's add to every sample.

Paddle's residual is a multiply by the per-sample mask and an add, two ops and two gradient
nodes (and neither is needed for the mask when there is none). `residual_add` computes the
sum in one or two numpy passes over a new tensor, split by samples over the kernel threads;
its backward hands the output gradient on to x unchanged and gives the branch that gradient
times m. `add_to_every_sample`'s backward sums the gradient over the samples as one GEMV, not
Paddle's broadcast-add reduction. Under any other condition (not the CPU kernel set, not
float32, `to_static`) both are Paddle's multiply and add.
"""
import numpy as np
import paddle
from paddle.autograd import PyLayer

from ..kernels.cpu_kernels import applies, as_numpy, run_split

__all__ = ["residual_add", "takes_residual_path", "add_to_every_sample"]


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
        y, a, b = as_numpy(out), as_numpy(x), as_numpy(branch)

        def add(lo, hi):
            if factor is None:
                np.add(a[lo:hi], b[lo:hi], out=y[lo:hi])
            else:
                np.multiply(b[lo:hi], _per_sample(factor[lo:hi], b.ndim), out=y[lo:hi])
                np.add(a[lo:hi], y[lo:hi], out=y[lo:hi])
        run_split(add, y.shape[0])
        ctx.factor = factor
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.factor is None:
            return grad, grad
        dbranch = paddle.empty(grad.shape, dtype=grad.dtype)
        g, d, factor = as_numpy(grad), as_numpy(dbranch), ctx.factor

        def scale(lo, hi):
            np.multiply(g[lo:hi], _per_sample(factor[lo:hi], g.ndim), out=d[lo:hi])
        run_split(scale, g.shape[0])
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


class _AddToEverySample(PyLayer):
    @staticmethod
    def forward(ctx, x, p):
        out = paddle.empty(x.shape, dtype=x.dtype)
        np.add(as_numpy(x), as_numpy(p), out=as_numpy(out))
        ctx.needs = (not x.stop_gradient, not p.stop_gradient)
        ctx.p_shape = p.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        need_x, need_p = ctx.needs
        dp = None
        if need_p:  # the sum over the samples as one GEMV (Paddle's broadcast-add gradient is a
            # slow reduction: docs/performance.md)
            grad = grad if grad.is_contiguous() else grad.contiguous()
            ones = paddle.ones([1, grad.shape[0]], dtype=grad.dtype)
            dp = paddle.matmul(ones, grad.reshape([grad.shape[0], -1])).reshape(ctx.p_shape)
        return grad if need_x else None, dp


def add_to_every_sample(x, p):
    """x + p for x `[B, ...]` and p `[1, ...]` (a position embedding); one PyLayer on the CPU
    kernel set whose gradient of p is a GEMV, Paddle's broadcast add otherwise."""
    if (paddle.in_dynamic_mode() and applies(x, p) and p.ndim == x.ndim and p.shape[0] == 1
            and p.shape[1:] == x.shape[1:]):
        return _AddToEverySample.apply(x, p)
    return x + p
