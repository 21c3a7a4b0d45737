"""A Linear layer followed by ReLU6 (ViT's fc1 and its activation) as one PyLayer on the CPU
kernel set.

Paddle runs the pair as two ops and two gradient nodes, the activation's a pass of its own
over the `[rows, hidden]` output in each direction. `linear_relu6` computes
y = min(max(x·W + b, 0), 6) with `plsc.models.linear`'s GEMMs and oneDNN's clip applied in
place on the GEMM's output (`plsc.kernels.onednn.eltwise`); the backward takes the activation's
gradient from y (dz = dy where 0 < y < 6, else 0: Paddle's and torch's ReLU6 gradient) and
then the GEMMs. It keeps y only, not x·W + b. Under any other condition (not the CPU kernel
set, oneDNN not loaded, `to_static`) it is Paddle's `F.linear` and `F.relu6`.
"""
import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from ..kernels import onednn
from ..kernels.onednn.eltwise import clip_plan
from .linear import gemm_forward, gemm_grads, save_gemm_context, takes_gemm_path

__all__ = ["linear_relu6", "takes_linear_relu6_path"]

RELU6_HIGH = 6.0


def takes_linear_relu6_path(x, weight):
    """True when `linear_relu6` runs as the one PyLayer (see the module docstring)."""
    return takes_gemm_path(x, weight) and onednn.available()


class _GemmLinearReLU6(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, bias):
        y, rows = gemm_forward(x, weight, bias)
        ctx.plan = clip_plan(y.size, 0.0, RELU6_HIGH)
        ctx.plan.forward(y.data_ptr(), y.data_ptr())  # in place
        return y.reshape(save_gemm_context(ctx, x, weight, bias, rows, weight, y))

    @staticmethod
    def backward(ctx, grad):
        rows, weight, y = ctx.saved_tensor()
        grad = grad if grad.is_contiguous() else grad.contiguous()
        dz = paddle.empty(y.shape, dtype=y.dtype)
        ctx.plan.backward(y.data_ptr(), grad.data_ptr(), dz.data_ptr())
        return gemm_grads(ctx, rows, weight, dz)


def linear_relu6(x, weight, bias=None):
    """ReLU6(x·W + b) (`weight` `[in, out]`, `bias` `[out]` or None; see the module
    docstring)."""
    if takes_linear_relu6_path(x, weight):
        return _GemmLinearReLU6.apply(x, weight, bias)
    return F.relu6(F.linear(x, weight, bias))
