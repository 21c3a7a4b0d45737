"""A transpose that hands on a dense tensor, copied by numpy on the CPU kernel set.

Paddle 3.3's `transpose` returns a strided view; the next op that needs dense memory (a reshape, a
matmul, the gradient of either) copies it with Paddle's strided-copy kernel, which is many times
slower than numpy's copy of the same view (timings: docs/performance.md, "plsc's own CPU kernels,
measured"). `permute` returns the permuted tensor already dense: on float32 CPU tensors under the
CPU kernel set (`plsc.kernels.cpu_kernels.applies`) a PyLayer whose forward and backward are numpy copies
(the backward with the inverse permutation) split over the kernel threads; otherwise Paddle's
`transpose` followed by `contiguous`.
"""
import numpy as np
import paddle
from paddle.autograd import PyLayer

from ..kernels.cpu_kernels import applies, as_numpy, run_split

__all__ = ["permute"]


def _dense_permuted(x, perm):
    src = as_numpy(x).transpose(perm)
    out = paddle.empty(list(src.shape), dtype=x.dtype)
    dst = as_numpy(out)

    def copy(lo, hi):  # slabs of the output's first axis, over the kernel threads
        np.copyto(dst[lo:hi], src[lo:hi])
    run_split(copy, dst.shape[0])
    return out


class _Permute(PyLayer):
    @staticmethod
    def forward(ctx, x, perm):
        ctx.inverse = [int(i) for i in np.argsort(perm)]
        return _dense_permuted(x, perm)

    @staticmethod
    def backward(ctx, grad):
        return _dense_permuted(grad, ctx.inverse)


def permute(x, perm):
    """`x.transpose(perm)` as a dense tensor (see the module docstring)."""
    perm = [int(p) for p in perm]
    if paddle.in_dynamic_mode() and applies(x):
        return _Permute.apply(x, perm)
    return x.transpose(perm).contiguous()
