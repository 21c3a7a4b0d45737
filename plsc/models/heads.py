"""The attention's heads from the qkv projection: q (scaled), k and v, each `[B, heads, L, d]`,
dense, as one PyLayer of numpy copies on the CPU kernel set.

Paddle's way is a reshape, a transpose copied dense (`plsc.models.permute`), an unbind and a
scale of the scores `[B, heads, L, L]` after q·kᵀ: four ops and their gradient nodes, the
scale a pass over L/d times more values than q has. `split_heads` copies q, k and v out of
qkv `[B, L, 3·heads·d]` in one pass, multiplying q by `scale` as it copies (q·kᵀ then comes
out scaled: the same scores up to float32 rounding); its backward writes the three gradients
back into one `[B, L, 3·heads·d]` tensor, dq times `scale`. The copies are split by samples
over the kernel threads (`plsc.kernels.cpu_kernels.run_rows`). Under any other condition (not the CPU
kernel set, not float32, `to_static`) it is Paddle's reshape, transpose, unbind and scale.
"""
import numpy as np
import paddle
from paddle.autograd import PyLayer

from ..kernels.cpu_kernels import applies, as_numpy, run_split

__all__ = ["split_heads", "takes_heads_path"]


def takes_heads_path(qkv):
    """True when `split_heads` runs as the numpy PyLayer (see the module docstring)."""
    return paddle.in_dynamic_mode() and applies(qkv) and qkv.ndim == 3


class _SplitHeads(PyLayer):
    @staticmethod
    def forward(ctx, qkv, heads, scale):
        batch, length, width = qkv.shape
        d = width // (3 * heads)
        src = as_numpy(qkv).reshape(batch, length, 3, heads, d)
        outs = [paddle.empty([batch, heads, length, d], dtype=qkv.dtype) for _ in range(3)]
        dst = [as_numpy(t) for t in outs]
        factor = np.float32(scale)

        def copy(lo, hi):
            np.multiply(src[lo:hi, :, 0].transpose(0, 2, 1, 3), factor, out=dst[0][lo:hi])
            for j in (1, 2):
                np.copyto(dst[j][lo:hi], src[lo:hi, :, j].transpose(0, 2, 1, 3))
        run_split(copy, batch)
        ctx.shape, ctx.factor = (batch, length, 3, heads, d), factor
        return tuple(outs)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        batch, length, _, heads, d = ctx.shape
        out = paddle.empty([batch, length, 3 * heads * d], dtype=paddle.float32)
        dst = as_numpy(out).reshape(ctx.shape)
        grads = [None if g is None else as_numpy(g) for g in (dq, dk, dv)]

        def copy(lo, hi):
            for j, g in enumerate(grads):
                part = dst[lo:hi, :, j]
                if g is None:
                    part.fill(0.0)
                elif j == 0:
                    np.multiply(g[lo:hi].transpose(0, 2, 1, 3), ctx.factor, out=part)
                else:
                    np.copyto(part, g[lo:hi].transpose(0, 2, 1, 3))
        run_split(copy, batch)
        return out


def split_heads(qkv, heads, scale):
    """(q·scale, k, v), each `[B, heads, L, d]`, from qkv `[B, L, 3·heads·d]` (q, k, v one
    after the other, each of `heads` contiguous groups of d columns; see the module
    docstring)."""
    if takes_heads_path(qkv):
        return _SplitHeads.apply(qkv, int(heads), float(scale))
    batch, length, width = qkv.shape
    parts = qkv.reshape([batch, length, 3, heads, width // (3 * heads)])
    q, k, v = paddle.unbind(parts.transpose([2, 0, 3, 1, 4]), axis=0)
    return q * scale, k, v
