"""The backbones' fully connected layer: Paddle's `nn.Linear`, with a cheaper bias gradient on the
CPU kernel set.

Paddle 3.3 computes a linear layer as a matmul and a broadcast add; the add's gradient sums the
output gradient over its rows with a reduction many times slower than a GEMV of the same data
(timings: docs/performance.md, "plsc's own CPU kernels, measured"). `Linear` keeps `nn.Linear`'s
parameters, names and initialisation; on float32 CPU tensors under the CPU kernel set
(`plsc.kernels.cpu_kernels.applies`), while not traced by `to_static`, its forward and backward are one
PyLayer of GEMMs: y = x·W + b, dx = g·Wᵀ, dW = xᵀ·g, db = 1ᵀ·g. Every other tensor takes
`nn.Linear`'s own forward.
"""
import paddle
from paddle import nn
from paddle.autograd import PyLayer

from ..kernels.cpu_kernels import applies

__all__ = ["Linear", "takes_gemm_path", "gemm_forward", "gemm_backward", "needs_grads",
           "save_gemm_context", "gemm_grads"]


def takes_gemm_path(x, weight):
    """True when `Linear` runs as the PyLayer of GEMMs (see the module docstring)."""
    return paddle.in_dynamic_mode() and applies(x, weight) and x.ndim >= 2


def _rows(t, width):
    t = t if t.is_contiguous() else t.contiguous()
    return t.reshape([-1, width])


def gemm_forward(x, weight, bias):
    """(x·W + b as `[rows, out]`, x as `[rows, in]`): one GEMM, the bias as its C operand
    (beta = 1), not a second pass."""
    rows = _rows(x, weight.shape[0])
    y = paddle.matmul(rows, weight) if bias is None else paddle.addmm(bias, rows, weight)
    return y, rows


def gemm_backward(rows, weight, g, x_shape, needs):
    """(dx, dW, db) of y = x·W + b from the output gradient `g` (`[rows, out]`); `needs`:
    which of the three to compute (None for the others)."""
    need_x, need_w, need_b = needs
    dx = paddle.matmul(g, weight, transpose_y=True).reshape(x_shape) if need_x else None
    dw = paddle.matmul(rows, g, transpose_x=True) if need_w else None
    db = None
    if need_b:
        ones = paddle.ones([1, g.shape[0]], dtype=g.dtype)
        db = paddle.matmul(ones, g).reshape([weight.shape[1]])
    return dx, dw, db


def needs_grads(x, weight, bias):
    """Which of (x, weight, bias) want a gradient."""
    return (not x.stop_gradient, not weight.stop_gradient,
            bias is not None and not bias.stop_gradient)


def save_gemm_context(ctx, x, weight, bias, *saved):
    """A GEMM PyLayer's forward bookkeeping: `saved` kept for the backward, x's shape, which
    gradients are wanted, whether there is a bias; returns the output's shape."""
    ctx.save_for_backward(*saved)
    ctx.x_shape = x.shape
    ctx.needs = needs_grads(x, weight, bias)
    ctx.has_bias = bias is not None
    return list(x.shape[:-1]) + [weight.shape[1]]


def gemm_grads(ctx, rows, weight, g):
    """A GEMM PyLayer's backward result for the output gradient `g` (`[rows, out]`), as the
    PyLayer returns it (no bias gradient without a bias)."""
    dx, dw, db = gemm_backward(rows, weight, g, ctx.x_shape, ctx.needs)
    return (dx, dw, db) if ctx.has_bias else (dx, dw)


class _GemmLinear(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, bias):
        y, rows = gemm_forward(x, weight, bias)
        return y.reshape(save_gemm_context(ctx, x, weight, bias, rows, weight))

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensor()
        return gemm_grads(ctx, rows, weight, _rows(grad, weight.shape[1]))


class Linear(nn.Linear):
    """`paddle.nn.Linear` whose CPU float32 forward and backward are GEMMs only."""

    def forward(self, x):
        if not takes_gemm_path(x, self.weight):
            return super().forward(x)
        return _GemmLinear.apply(x, self.weight, self.bias)
