"""The backbones' 2-D convolution: oneDNN's on the CPU kernel set, Paddle's `conv2d` otherwise.

`Conv2D` is `paddle.nn.Conv2D` (same parameters, names and initialisation, so weights load and
save as before) whose forward runs through `plsc.kernels.onednn` when the input and the parameters are
float32 CPU tensors under the CPU kernel set (`plsc.kernels.cpu_kernels.cpu_set`) and the bundled
oneDNN loaded; any other tensor (another device or dtype, ``PLSC_KERNELS=device``) takes
Paddle's own `conv2d`, as on a GPU. Both compute the same convolution (timings:
docs/performance.md, "plsc's own CPU kernels, measured").
"""
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
    return p, ([n, c // blocked.BLOCK, h, w, blocked.BLOCK] if blocked_out else list(p.out_shape))


class _OneDNNConv2D(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, bias, geometry, blocked_out):
        ctx.needs = (not x.stop_gradient, not weight.stop_gradient,
                     bias is not None and not bias.stop_gradient)  # before any dense copy
        x, weight = _dense(x), _dense(weight)
        plan, out_shape = _plan(x, weight, bias, geometry, blocked_out)
        y = paddle.empty(out_shape, dtype=paddle.float32)
        onednn.conv_forward(plan, x.data_ptr(), weight.data_ptr(),
                            None if bias is None else bias.data_ptr(), y.data_ptr())
        ctx.plan = plan
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensor()
        dy = _dense(dy)
        need_x, need_w, need_b = ctx.needs
        dx = paddle.empty(x.shape, dtype=paddle.float32) if need_x else None
        dw = paddle.empty(weight.shape, dtype=paddle.float32) if (need_w or need_b) else None
        db = (paddle.empty([weight.shape[0]], dtype=paddle.float32)
              if ctx.has_bias and (need_w or need_b) else None)
        onednn.conv_backward(ctx.plan, x.data_ptr(), weight.data_ptr(), dy.data_ptr(),
                             None if dx is None else dx.data_ptr(),
                             None if dw is None else dw.data_ptr(),
                             None if db is None else db.data_ptr())
        grads = (dx, dw if need_w else None)
        return grads + ((db if need_b else None),) if ctx.has_bias else grads


def _forward_no_grad(x, weight, bias, geometry, blocked_out):
    """The convolution without an autograd record, the batch in pieces of
    `onednn.samples_per_call` samples (each sample's output depends on that sample alone)."""
    x, weight = _dense(x), _dense(weight)
    full, out_shape = _plan(x, weight, bias, geometry, blocked_out)
    y = paddle.empty(out_shape, dtype=paddle.float32)
    n = int(x.shape[0])
    step = max(1, onednn.samples_per_call(full, n))  # an empty batch: no call
    x_bytes, y_bytes = 4 * int(x.size) // max(n, 1), 4 * int(y.size) // max(n, 1)
    b_ptr = None if bias is None else bias.data_ptr()
    for lo in range(0, n, step):
        k = min(step, n - lo)
        plan = full if k == n else _plan(x, weight, bias, geometry, blocked_out, k)[0]
        onednn.conv_forward(plan, x.data_ptr() + lo * x_bytes, weight.data_ptr(), b_ptr,
                            y.data_ptr() + lo * y_bytes)
    return y


class Conv2D(nn.Conv2D):
    """`paddle.nn.Conv2D` (NCHW) whose CPU float32 forward and backward run through oneDNN;
    under `paddle.no_grad` (an evaluation) the forward alone, in pieces of the batch that keep
    oneDNN's shared scratch at the size training gave it.

    A blocked input (`plsc.models.blocked`) gives a blocked output, and with `emit_blocked`
    set a plain input does too where oneDNN's own choice is that layout
    (`onednn.blocked_native`), unless the output's channels do not fill blocks of 16 or the
    convolution is grouped (then the output is plain)."""

    emit_blocked = False

    def forward(self, x):
        padding = _explicit_padding(self)
        if padding is None or not takes_onednn(x, self.weight):
            return super().forward(blocked.to_plain(x) if blocked.is_blocked(x) else x)
        geometry = (_pair(self._stride),) + padding + (_pair(self._dilation), int(self._groups))
        blocked_out = ((blocked.is_blocked(x) or (self.emit_blocked and onednn.blocked_native()))
                       and self._groups == 1 and self._out_channels % blocked.BLOCK == 0)
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
