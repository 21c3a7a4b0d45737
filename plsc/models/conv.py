"""The backbones' 2-D convolution: oneDNN's on the CPU kernel set, Paddle's `conv2d` otherwise.

`Conv2D` is `paddle.nn.Conv2D` (same parameters, names and initialisation, so weights load and
save as before) whose forward runs through `plsc.kernels.onednn` when the input and the parameters are
float32 CPU tensors under the CPU kernel set (`plsc.kernels.cpu_kernels.cpu_set`) and the bundled
oneDNN loaded; any other tensor (another device or dtype, ``PLSC_KERNELS=device``) takes
Paddle's own `conv2d`, as on a GPU. Both compute the same convolution (timings:
docs/performance.md, "plsc's own CPU kernels, measured").
"""
import math

import paddle
from paddle import nn
from paddle.autograd import PyLayer

from . import blocked
from ..kernels import cpu_kernels, onednn

__all__ = ["Conv2D", "takes_onednn"]


def _pair(v):
    return (int(v), int(v)) if isinstance(v, int) else tuple(int(i) for i in v)


def takes_onednn(x, weight):
    """True when this convolution runs through oneDNN (see the module docstring); never while
    a program is traced (`paddle.jit.to_static`): an exported model holds Paddle's conv2d."""
    return (paddle.in_dynamic_mode() and cpu_kernels.cpu_set(x, weight) and x.dtype == paddle.float32
            and weight.dtype == paddle.float32 and (x.ndim == 4 or blocked.is_blocked(x))
            and onednn.available())


def _dense(t):
    return t if t.is_contiguous() else t.contiguous()


def _plan(x, weight, bias, geometry, blocked_out, n=None):
    """The oneDNN plan of this call (`n`: another batch size) and its output's shape."""
    blocked_in = blocked.is_blocked(x)
    shape = blocked.logical_shape(x) if blocked_in else [int(d) for d in x.shape]
    if n is not None:
        shape[0] = n
    p = onednn.plan(shape, weight.shape, *geometry, bias is not None, blocked_in, blocked_out)
    n, c, h, w = p.out_shape
    b = blocked.block()
    return p, ([n, c // b, h, w, b] if blocked_out else list(p.out_shape))


def _pieces(x, out_shape, weight, bias, geometry, blocked_out, full):
    """(plan, byte offset into x, byte offset into y) of each piece of the batch: pieces of
    `onednn.samples_per_call` samples, so that no staged (reordered) activation grows oneDNN's
    shared scratch past its budget (where activations stay plain, IResNet18's 112 x 112
    ones at batch 32 would otherwise hold two 103 MB slots). Each sample's output
    and data gradient depend on that sample alone; the weight gradient is a sum over samples."""
    n = int(x.shape[0])
    step = max(1, onednn.samples_per_call(full, n))  # an empty batch: no call
    x_bytes = 4 * int(x.size) // max(n, 1)
    y_bytes = 4 * math.prod(int(d) for d in out_shape[1:])
    for lo in range(0, n, step):
        k = min(step, n - lo)
        plan = full if k == n else _plan(x, weight, bias, geometry, blocked_out, k)[0]
        yield plan, lo * x_bytes, lo * y_bytes


class _OneDNNConv2D(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, bias, geometry, blocked_out):
        ctx.needs = (not x.stop_gradient, not weight.stop_gradient,
                     bias is not None and not bias.stop_gradient)  # before any dense copy
        x, weight = _dense(x), _dense(weight)
        y = _forward_no_grad(x, weight, bias, geometry, blocked_out)
        ctx.call = (geometry, blocked_out)
        ctx.has_bias = bias is not None
        ctx.out_shape = y.shape
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensor()
        dy = _dense(dy)
        need_x, need_w, need_b = ctx.needs
        dx = paddle.empty(x.shape, dtype=paddle.float32) if need_x else None
        grads_w = need_w or need_b
        dw = paddle.empty(weight.shape, dtype=paddle.float32) if grads_w else None
        db = (paddle.empty([weight.shape[0]], dtype=paddle.float32)
              if ctx.has_bias and grads_w else None)
        part_dw = part_db = None
        geometry, blocked_out = ctx.call
        bias = db if ctx.has_bias else None  # only its presence shapes the plan
        full = _plan(x, weight, bias, geometry, blocked_out)[0]
        for i, (plan, xo, yo) in enumerate(_pieces(x, ctx.out_shape, weight, bias, geometry,
                                                   blocked_out, full)):
            if i == 1 and grads_w:  # the later pieces' parameter gradients, then summed
                part_dw = paddle.empty(weight.shape, dtype=paddle.float32)
                part_db = paddle.empty([weight.shape[0]], dtype=paddle.float32) \
                    if db is not None else None
            to_w, to_b = (dw, db) if i == 0 else (part_dw, part_db)
            onednn.conv_backward(plan, x.data_ptr() + xo, weight.data_ptr(), dy.data_ptr() + yo,
                                 None if dx is None else dx.data_ptr() + xo,
                                 None if to_w is None else to_w.data_ptr(),
                                 None if to_b is None else to_b.data_ptr())
            if i and grads_w:
                dw.add_(part_dw)
                if db is not None:
                    db.add_(part_db)
        grads = (dx, dw if need_w else None)
        return grads + ((db if need_b else None),) if ctx.has_bias else grads


def _forward_no_grad(x, weight, bias, geometry, blocked_out):
    """The convolution without an autograd record, the batch in `_pieces`."""
    x, weight = _dense(x), _dense(weight)
    full, out_shape = _plan(x, weight, bias, geometry, blocked_out)
    y = paddle.empty(out_shape, dtype=paddle.float32)
    b_ptr = None if bias is None else bias.data_ptr()
    for plan, xo, yo in _pieces(x, out_shape, weight, bias, geometry, blocked_out, full):
        onednn.conv_forward(plan, x.data_ptr() + xo, weight.data_ptr(), b_ptr, y.data_ptr() + yo)
    return y


class Conv2D(nn.Conv2D):
    """`paddle.nn.Conv2D` (NCHW) whose CPU float32 forward and backward run through oneDNN;
    under `paddle.no_grad` (an evaluation) the forward alone, in pieces of the batch that keep
    oneDNN's shared scratch at the size training gave it.

    A blocked input (`plsc.models.blocked`) gives a blocked output, and with `emit_blocked`
    set a plain input does too where oneDNN's own choice is that layout
    (`onednn.blocked_native`), unless the output's channels do not fill whole blocks
    (`blocked.block()`: 16 or 8) or the convolution is grouped (then the output is plain)."""

    emit_blocked = False

    def forward(self, x):
        padding = _explicit_padding(self)
        if padding is None or not takes_onednn(x, self.weight):
            return super().forward(blocked.to_plain(x) if blocked.is_blocked(x) else x)
        geometry = (_pair(self._stride),) + padding + (_pair(self._dilation), int(self._groups))
        blocked_out = ((blocked.is_blocked(x) or (self.emit_blocked and onednn.blocked_native()))
                       and self._groups == 1 and self._out_channels % blocked.block() == 0)
        if not paddle.is_grad_enabled():
            return _forward_no_grad(x, self.weight, self.bias, geometry, blocked_out)
        return _OneDNNConv2D.apply(x, self.weight, self.bias, geometry, blocked_out)


def _explicit_padding(layer):
    """((top, left), (bottom, right)) of an NCHW zero-padded layer with explicit padding, else
    None (a "SAME"/"VALID" string or another layout goes to Paddle's conv2d)."""
    if (layer._data_format != "NCHW" or layer._padding_mode != "zeros"
            or layer._padding_algorithm != "EXPLICIT"):
        return None
    pad = [int(p) for p in layer._updated_padding]
    if len(pad) == 2:
        return (pad[0], pad[1]), (pad[0], pad[1])
    if len(pad) == 4:
        return (pad[0], pad[2]), (pad[1], pad[3])
    return None
