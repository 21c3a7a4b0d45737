"""PReLU on oneDNN's kernels on the CPU kernel set, Paddle's `prelu` otherwise.

Paddle 3.3's CPU prelu is a scalar loop on one thread, a large share of an IResNet training step
on the CPU (timings: docs/performance.md, "plsc's own CPU kernels, measured"). Here a float32
CPU tensor with its channels on axis 1 (plain [N, C, ...], or a blocked activation of
`plsc.models.blocked`, which stays blocked) and one slope per channel or one for all runs on
oneDNN's PReLU (`plsc.kernels.onednn.prelu`), on the tensors' own memory:

    forward   y = x if x > 0 else a·x
    backward  dx = dy if x > 0 else a·dy,    da = Σ dy·x over the x ≤ 0, per channel

`y` and `dx` equal Paddle's kernel for any slopes (a zero product may be +0 where Paddle's is
-0); `da` is the same sum in another order, which does not depend on the thread count. Other inputs (other devices or dtypes,
channels-last, ``PLSC_KERNELS=device``), static graphs (export) and a process whose oneDNN did
not load use `paddle.nn.functional.prelu`.
"""
import math

import paddle
from paddle import nn
from paddle.autograd import PyLayer

from . import blocked
from ..kernels import onednn
from ..kernels.cpu_kernels import applies

__all__ = ["PReLU", "prelu"]

_CHANNELS_FIRST = ("NCHW", "NCL", "NC", "NCDHW")


def _plan(x, slope, lanes):
    """The oneDNN plan of `x`: a blocked activation as its logical [N, C, H, W] in blocks,
    a plain [N, C, ...] as [N, C, rest, 1]."""
    if lanes:
        return onednn.prelu_plan(blocked.logical_shape(x), slope.size, blocked.block())
    n, c = int(x.shape[0]), int(x.shape[1])
    rest = math.prod(int(d) for d in x.shape[2:])
    return onednn.prelu_plan((n, c, rest, 1), slope.size)


class _OneDNNPReLU(PyLayer):
    @staticmethod
    def forward(ctx, x, slope, lanes):
        plan = _plan(x, slope, lanes)
        y = paddle.empty(x.shape, dtype=paddle.float32)
        plan.forward(x.data_ptr(), slope.data_ptr(), y.data_ptr())
        ctx.save_for_backward(x, slope)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, grad):
        x, slope = ctx.saved_tensor()
        grad = grad if grad.is_contiguous() else grad.contiguous()
        d_x = paddle.empty(x.shape, dtype=paddle.float32)
        d_slope = paddle.empty(slope.shape, dtype=paddle.float32)
        ctx.plan.backward(x.data_ptr(), slope.data_ptr(), grad.data_ptr(), d_x.data_ptr(),
                          d_slope.data_ptr())
        return d_x, d_slope


def _onednn_ok(x, slope, data_format, lanes):
    """True when this call runs on oneDNN's kernels (see the module docstring)."""
    if not (paddle.in_dynamic_mode() and applies(x, slope) and x.ndim >= 2
            and data_format in _CHANNELS_FIRST and onednn.available()):
        return False
    channels = blocked.logical_shape(x)[1] if lanes else int(x.shape[1])
    return slope.size in (1, channels)


def _dense(t):
    return t if t.is_contiguous() else t.contiguous()


def prelu(x, slope, data_format="NCHW"):
    """`paddle.nn.functional.prelu(x, slope, data_format)`, on oneDNN's kernels when they
    apply (see the module's docstring); a blocked activation (`plsc.models.blocked`, NCHW)
    stays blocked."""
    lanes = data_format == "NCHW" and blocked.is_blocked(x)
    if _onednn_ok(x, slope, data_format, lanes):
        return _OneDNNPReLU.apply(_dense(x), _dense(slope), lanes)
    if lanes:
        return blocked.to_blocked(paddle.nn.functional.prelu(blocked.to_plain(x), slope))
    return paddle.nn.functional.prelu(x, slope, data_format=data_format)


class PReLU(nn.PReLU):
    """`paddle.nn.PReLU` (same parameter, same state_dict key `weight`) on `prelu`'s kernels."""

    def forward(self, x):
        return prelu(x, self._weight, self._data_format)
