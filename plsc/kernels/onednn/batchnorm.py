"""oneDNN's batch normalization (training forward and backward) on blocked float32 memory.

For a backbone that keeps its activations in oneDNN's blocked layout (nChw16c or nChw8c:
`plsc.kernels.onednn.conv.block`, `plsc.models.blocked`): there oneDNN's jit kernel runs
BatchNorm faster than Paddle's CPU kernel on the plain layout (IResNet50's largest map,
[32, 64, 112, 112], one thread, AVX-512: 14.3 + 17.4 ms against 22.0 + 43.9,
docs/performance.md), while on the plain layout it is slower. The forward returns the batch's
mean and biased variance (the running statistics are the caller's); the backward gives dx,
d(scale) and d(shift); `infer` normalises with given (running) statistics, without gradients.
One plan per (shape, epsilon, block), kept for the process.
"""
import ctypes

from .conv import block, blocked_tag
from .library import (ARG_DIFF_DST, ARG_DIFF_SCALE, ARG_DIFF_SHIFT, ARG_DIFF_SRC, ARG_DST,
                      ARG_MEAN, ARG_SCALE, ARG_SHIFT, ARG_SRC, ARG_VARIANCE, BACKWARD,
                      FORWARD_INFERENCE, FORWARD_TRAINING, TAG_A, USE_GLOBAL_STATS,
                      USE_SCALE, USE_SHIFT, bind, engine, execute, lib, md, memory, ok,
                      primitive, vp)

__all__ = ["batchnorm_plan"]

_plans = {}
_FLAGS = USE_SCALE | USE_SHIFT


class _BatchNorm:
    def __init__(self, shape, epsilon, size):
        if shape[1] % size:
            raise ValueError(f"blocked batch norm needs channels in blocks of {size}, "
                             f"got shape {shape}")
        self.data, self.stat = md(shape, blocked_tag(size)), md(shape[1:2], TAG_A)
        self.epsilon = float(epsilon)
        self.fwd_pd = vp()
        ok(lib().dnnl_batch_normalization_forward_primitive_desc_create(
            ctypes.byref(self.fwd_pd), engine(), FORWARD_TRAINING, self.data, self.data,
            self.epsilon, _FLAGS, None), "batch_normalization_forward_primitive_desc_create")
        self.fwd = primitive(self.fwd_pd)
        self.bwd = self.inference = None
        self.mem = {arg: memory(self.data) for arg in (ARG_SRC, ARG_DST, ARG_DIFF_DST,
                                                       ARG_DIFF_SRC)}
        self.mem.update({arg: memory(self.stat) for arg in (
            ARG_MEAN, ARG_VARIANCE, ARG_SCALE, ARG_SHIFT, ARG_DIFF_SCALE, ARG_DIFF_SHIFT)})

    def forward(self, x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, var_ptr):
        """y = (x - mean) / sqrt(var + eps) * w + b over the batch's statistics, which it
        writes to `mean_ptr` and `var_ptr` (the biased variance)."""
        execute(self.fwd, bind(self.mem, {ARG_SRC: x_ptr, ARG_DST: y_ptr, ARG_SCALE: w_ptr,
                                          ARG_SHIFT: b_ptr, ARG_MEAN: mean_ptr,
                                          ARG_VARIANCE: var_ptr}))

    def infer(self, x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, var_ptr):
        """y = (x - mean) / sqrt(var + eps) * w + b over given (running) statistics."""
        if self.inference is None:
            pd = vp()
            ok(lib().dnnl_batch_normalization_forward_primitive_desc_create(
                ctypes.byref(pd), engine(), FORWARD_INFERENCE, self.data, self.data,
                self.epsilon, _FLAGS | USE_GLOBAL_STATS, None),
                "batch_normalization_forward_primitive_desc_create")
            self.inference = primitive(pd)
        execute(self.inference, bind(self.mem, {ARG_SRC: x_ptr, ARG_DST: y_ptr,
                                                ARG_SCALE: w_ptr, ARG_SHIFT: b_ptr,
                                                ARG_MEAN: mean_ptr, ARG_VARIANCE: var_ptr}))

    def backward(self, x_ptr, w_ptr, mean_ptr, var_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr):
        """dx, dw, db of `forward` for dy (mean and var: what the forward wrote)."""
        if self.bwd is None:
            pd = vp()
            ok(lib().dnnl_batch_normalization_backward_primitive_desc_create(
                ctypes.byref(pd), engine(), BACKWARD, self.data, self.data, self.data,
                self.epsilon, _FLAGS, self.fwd_pd, None),
                "batch_normalization_backward_primitive_desc_create")
            self.bwd = primitive(pd)
        execute(self.bwd, bind(self.mem, {
            ARG_SRC: x_ptr, ARG_MEAN: mean_ptr, ARG_VARIANCE: var_ptr, ARG_DIFF_DST: dy_ptr,
            ARG_SCALE: w_ptr, ARG_DIFF_SRC: dx_ptr, ARG_DIFF_SCALE: dw_ptr,
            ARG_DIFF_SHIFT: db_ptr}))


def batchnorm_plan(shape, epsilon):
    """The batch norm plan of logical NCHW `shape` held in blocks of `block()` channels."""
    key = (tuple(int(d) for d in shape), float(epsilon), block())
    if key not in _plans:
        _plans[key] = _BatchNorm(*key)
    return _plans[key]
