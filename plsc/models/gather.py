"""Rows of each sample picked by index, `out[b, i] = x[b, ids[b, i]]`, as a PyLayer of numpy
passes on the CPU kernel set (the ViT's token masking and its undoing).

Paddle's way is `take_along_axis` with the indices tiled over the row width, whose gradient
is a scatter-add several times slower than the gather. The indices of one sample here are
distinct (a permutation or part of one), so the backward is a plain scatter: dx is zero
where no row was picked and the output's gradient where one was. Under any other condition
(not the CPU kernel set, not float32, `to_static`) it is Paddle's `take_along_axis`.
"""
import numpy as np
import paddle
from paddle.autograd import PyLayer

from ..kernels.cpu_kernels import applies, as_numpy

__all__ = ["take_rows_per_sample"]


class _TakeRows(PyLayer):
    @staticmethod
    def forward(ctx, x, ids):
        idx, src = as_numpy(ids).copy(), as_numpy(x)  # idx: kept for the backward
        out = paddle.empty([x.shape[0], idx.shape[1], x.shape[2]], dtype=x.dtype)
        dst = as_numpy(out)
        for b in range(idx.shape[0]):  # whole rows: np.take copies each at once
            np.take(src[b], idx[b], axis=0, out=dst[b])
        ctx.idx, ctx.x_shape = idx, x.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        dx = paddle.zeros(ctx.x_shape, dtype=grad.dtype)
        dst, g = as_numpy(dx), as_numpy(grad)
        for b in range(ctx.idx.shape[0]):
            dst[b][ctx.idx[b]] = g[b]
        return dx


def take_rows_per_sample(x, ids):
    """x `[B, L, D]`, ids `[B, n]` (int64, distinct within a sample) -> `[B, n, D]` with
    out[b, i] = x[b, ids[b, i]] (see the module docstring)."""
    if paddle.in_dynamic_mode() and applies(x) and x.ndim == 3:
        return _TakeRows.apply(x, ids)
    return paddle.take_along_axis(x, ids.unsqueeze(-1).tile([1, 1, x.shape[2]]), axis=1)
