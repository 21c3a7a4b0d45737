"""oneDNN's PReLU (training forward and backward) on float32 memory, plain or blocked.

    forward   y = x if x > 0 else a·x
    backward  dx = dy if x > 0 else a·dy,    da = Σ dy·x over the x ≤ 0, per channel

with the slopes `a` per channel (axis 1) or one for all. `y` and `dx` equal Paddle's `prelu`
(one comparison, one product; only a zero product may be +0 where Paddle's is -0); `da` is a
float32 sum in oneDNN's order, the same for every thread count (tests/test_cpu_kernels.py).
oneDNN's jit kernels take the plain layout and the blocked ones (nChw16c, nChw8c) alike; on
[32, 64, 56, 56], one thread, forward + backward take 9.6 ms under the AVX2 cap against 18.7 ms
for the numpy kernel they replaced and torch's 39.8 ms (docs/performance.md, "PReLU on
oneDNN"). One plan per (shape, slopes, block), kept for the process.
"""
import ctypes

from .conv import blocked_tag
from .library import (ARG_DIFF_DST, ARG_DIFF_SRC, ARG_DIFF_WEIGHTS, ARG_DST, ARG_SRC,
                      ARG_WEIGHTS, FORWARD_TRAINING, TAG_ABCD, bind, engine, execute, lib, md,
                      memory, ok, primitive, vp)

__all__ = ["prelu_plan"]

_plans = {}


class _PReLU:
    def __init__(self, shape, slopes, size):
        self.data = md(shape, blocked_tag(size) if size else TAG_ABCD)
        # per-channel slopes in the data's own layout: jit kernels (a plain [C] vector either
        # way, the channels filling whole blocks); one slope broadcast to every element
        self.slopes = md((1, shape[1] if slopes > 1 else 1, 1, 1),
                         blocked_tag(size) if size and slopes > 1 else TAG_ABCD)
        self.fwd_pd = vp()
        ok(lib().dnnl_prelu_forward_primitive_desc_create(
            ctypes.byref(self.fwd_pd), engine(), FORWARD_TRAINING, self.data, self.slopes,
            self.data, None), "prelu_forward_primitive_desc_create")
        self.fwd = primitive(self.fwd_pd)
        self.bwd = None
        self.mem = {arg: memory(self.data) for arg in (ARG_SRC, ARG_DST, ARG_DIFF_DST,
                                                       ARG_DIFF_SRC)}
        self.mem.update({arg: memory(self.slopes) for arg in (ARG_WEIGHTS, ARG_DIFF_WEIGHTS)})

    def forward(self, x_ptr, a_ptr, y_ptr):
        """y = prelu(x) with slopes at `a_ptr`."""
        execute(self.fwd, bind(self.mem, {ARG_SRC: x_ptr, ARG_WEIGHTS: a_ptr, ARG_DST: y_ptr}))

    def backward(self, x_ptr, a_ptr, dy_ptr, dx_ptr, da_ptr):
        """dx and da of `forward` for dy."""
        if self.bwd is None:
            pd = vp()
            ok(lib().dnnl_prelu_backward_primitive_desc_create(
                ctypes.byref(pd), engine(), self.data, self.slopes, self.data, self.slopes,
                self.data, self.fwd_pd, None), "prelu_backward_primitive_desc_create")
            self.bwd = primitive(pd)
        execute(self.bwd, bind(self.mem, {ARG_SRC: x_ptr, ARG_WEIGHTS: a_ptr,
                                          ARG_DIFF_DST: dy_ptr, ARG_DIFF_SRC: dx_ptr,
                                          ARG_DIFF_WEIGHTS: da_ptr}))


def prelu_plan(shape, slopes, size=0):
    """The PReLU plan of logical NCHW `shape` with `slopes` slopes (1, or one per channel),
    the data plain (`size` 0) or in blocks of `size` channels."""
    key = (tuple(int(d) for d in shape), int(slopes), int(size))
    if key not in _plans:
        _plans[key] = _PReLU(*key)
    return _plans[key]
