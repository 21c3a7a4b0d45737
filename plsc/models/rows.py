"""Softmax and LayerNorm over the last axis: oneDNN's on the CPU kernel set, Paddle's otherwise.

Paddle 3.3's CPU softmax and LayerNorm gradient take several times torch's on the same rows
(ViT-T's attention scores and token norms; timings: docs/performance.md, "plsc's own CPU
kernels, measured"). On float32 CPU tensors under the CPU kernel set
(`plsc.kernels.cpu_kernels.applies`), with the bundled oneDNN loaded and while not traced by
`to_static`, `softmax_last` and `LayerNorm` are PyLayers whose forward and backward are oneDNN
primitives on the tensors' memory (`plsc.kernels.onednn.rows`); every other tensor takes Paddle's
`softmax` / `nn.LayerNorm`. `LayerNorm` keeps `nn.LayerNorm`'s parameters and names.
"""
import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.autograd import PyLayer

from ..kernels import onednn
from ..kernels.cpu_kernels import applies, softmax_grad
from ..kernels.onednn.rows import layer_norm_plan, softmax_plan

__all__ = ["softmax_last", "LayerNorm", "takes_onednn_rows"]


def takes_onednn_rows(*tensors):
    """True when these float32 CPU tensors run through oneDNN (see the module docstring)."""
    return paddle.in_dynamic_mode() and applies(*tensors) and onednn.available()


def _dense(t):
    return t if t.is_contiguous() else t.contiguous()


def _rows(t):
    return t.size // t.shape[-1], t.shape[-1]


class _Softmax(PyLayer):
    @staticmethod
    def forward(ctx, x):
        x = _dense(x)
        plan = softmax_plan(*_rows(x))
        y = paddle.empty(x.shape, dtype=paddle.float32)
        plan.forward(x.data_ptr(), y.data_ptr())
        ctx.plan = plan
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensor()
        grad = _dense(grad)
        if ctx.plan.backward_is_reference():  # oneDNN below AVX-512 (see the kernels' module)
            return softmax_grad(y, grad)
        dx = paddle.empty(y.shape, dtype=paddle.float32)
        ctx.plan.backward(y.data_ptr(), grad.data_ptr(), dx.data_ptr())
        return dx


def softmax_last(x):
    """Softmax over the last axis of `x` (see the module docstring)."""
    if takes_onednn_rows(x) and x.ndim >= 1:
        return _Softmax.apply(x)
    return F.softmax(x, axis=-1)


class _LayerNorm(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        ctx.needs = (not x.stop_gradient, not weight.stop_gradient, not bias.stop_gradient)
        x = _dense(x)
        rows, width = _rows(x)
        plan = layer_norm_plan(rows, width, eps)
        y = paddle.empty(x.shape, dtype=paddle.float32)
        mean = paddle.empty([rows], dtype=paddle.float32)
        var = paddle.empty([rows], dtype=paddle.float32)
        plan.forward(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(),
                     mean.data_ptr(), var.data_ptr())
        ctx.plan = plan
        ctx.save_for_backward(x, weight, bias, mean, var)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, var = ctx.saved_tensor()
        grad = _dense(grad)
        dx = paddle.empty(x.shape, dtype=paddle.float32)
        dw = paddle.empty(weight.shape, dtype=paddle.float32)
        db = paddle.empty(weight.shape, dtype=paddle.float32)
        ctx.plan.backward(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), mean.data_ptr(),
                          var.data_ptr(),
                          grad.data_ptr(), dx.data_ptr(), dw.data_ptr(), db.data_ptr())
        need_x, need_w, need_b = ctx.needs
        return dx if need_x else None, dw if need_w else None, db if need_b else None


class LayerNorm(nn.LayerNorm):
    """`paddle.nn.LayerNorm` over the last axis whose CPU float32 forward and backward run
    through oneDNN (see the module docstring)."""

    def forward(self, x):
        if (self.weight is None or self.bias is None or len(self._normalized_shape) != 1
                or not takes_onednn_rows(x, self.weight, self.bias)):
            return super().forward(x)
        return _LayerNorm.apply(x, self.weight, self.bias, float(self._epsilon))
