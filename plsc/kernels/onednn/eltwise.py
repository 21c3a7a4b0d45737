"""oneDNN's clip, min(max(x, low), high), on plain float32 memory, with its gradient from the
output: dx = dy where low < y < high, else 0 (oneDNN's `eltwise_clip_v2`; ReLU6 is clip(0, 6),
whose gradient Paddle and torch also take as 0 at both ends).

One plan per (size, low, high) holds the forward primitive and, built on first use, the
backward one. The forward may run in place (the same address for x and y).
"""
import ctypes

from .library import (ARG_DIFF_DST, ARG_DIFF_SRC, ARG_DST, ARG_SRC, ELTWISE_CLIP_V2,
                      ELTWISE_CLIP_V2_USE_DST, FORWARD_TRAINING, TAG_A, bind, engine, execute, lib,
                      md, memory, ok, primitive, vp)

__all__ = ["clip_plan"]

_plans = {}


class _Clip:
    def __init__(self, size, low, high):
        self.data = md((size,), TAG_A)
        self.low, self.high = low, high
        self.fwd_pd = vp()
        ok(lib().dnnl_eltwise_forward_primitive_desc_create(
            ctypes.byref(self.fwd_pd), engine(), FORWARD_TRAINING, ELTWISE_CLIP_V2_USE_DST,
            self.data, self.data, low, high, None), "eltwise_forward_primitive_desc_create")
        self.fwd = primitive(self.fwd_pd)
        self.bwd = None
        self.mem = {arg: memory(self.data) for arg in (ARG_SRC, ARG_DST, ARG_DIFF_DST,
                                                       ARG_DIFF_SRC)}

    def forward(self, x_ptr, y_ptr):
        """y = clip(x) (`y_ptr` may be `x_ptr`)."""
        execute(self.fwd, bind(self.mem, {ARG_SRC: x_ptr, ARG_DST: y_ptr}))

    def backward(self, y_ptr, dy_ptr, dx_ptr):
        """dx = dy where low < y < high, else 0 (`dx_ptr` may be `dy_ptr`)."""
        if self.bwd is None:
            pd = vp()
            ok(lib().dnnl_eltwise_backward_primitive_desc_create(
                ctypes.byref(pd), engine(), ELTWISE_CLIP_V2_USE_DST, self.data, self.data,
                self.data, self.low, self.high, self.fwd_pd, None),
                "eltwise_backward_primitive_desc_create")
            self.bwd = primitive(pd)
        execute(self.bwd, bind(self.mem, {ARG_DST: y_ptr, ARG_DIFF_DST: dy_ptr,
                                          ARG_DIFF_SRC: dx_ptr}))


def clip_plan(size, low, high):
    """The clip plan of `size` contiguous float32 values into [low, high]."""
    key = (int(size), float(low), float(high))
    if key not in _plans:
        _plans[key] = _Clip(*key)
    return _plans[key]
