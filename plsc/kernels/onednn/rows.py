"""oneDNN softmax and LayerNorm over the last axis of plain float32 [rows, width] memory.

One plan per (rows, width) (and epsilon for LayerNorm) holds the forward primitive and, built on
first use, the backward one; the memory objects are pointed at the tensors' memory at each
call. The layers that choose between these and Paddle's ops are in `plsc.models.rows`.

oneDNN 3.6 has no jit softmax backward below AVX-512 (ONEDNN_MAX_CPU_ISA=AVX2, or an AVX2
CPU): it runs its reference kernel, 14x its AVX-512 one on ViT-T's attention scores. A plan
says so (`_Softmax.backward_is_reference`) and the layer then takes numpy's
(`plsc.kernels.cpu_kernels.softmax_grad`).
"""
import ctypes

from .library import (ARG_DIFF_DST, ARG_DIFF_SCALE, ARG_DIFF_SHIFT, ARG_DIFF_SRC, ARG_DST,
                      ARG_MEAN, ARG_SCALE, ARG_SHIFT, ARG_SRC, ARG_VARIANCE, BACKWARD,
                      FORWARD_TRAINING, SOFTMAX_ACCURATE, TAG_A, TAG_AB, USE_SCALE, USE_SHIFT,
                      engine, execute, impl_info, lib, md, memory, ok, primitive, set_handle, vp)

__all__ = ["softmax_plan", "layer_norm_plan"]

_plans = {}


class _Memories:
    """One memory object per argument, pointed at the caller's addresses at each call."""

    def __init__(self, descs):
        self.mem = {arg: memory(d) for arg, d in descs.items()}

    def bind(self, ptrs):
        for arg, ptr in ptrs.items():
            set_handle(self.mem[arg], ptr)
        return [(arg, self.mem[arg]) for arg in ptrs]


class _Softmax:
    def __init__(self, rows, width):
        self.data = md((rows, width), TAG_AB)
        self.fwd_pd = vp()
        ok(lib().dnnl_softmax_forward_primitive_desc_create(
            ctypes.byref(self.fwd_pd), engine(), FORWARD_TRAINING, SOFTMAX_ACCURATE, self.data,
            self.data, 1, None), "softmax_forward_primitive_desc_create")
        self.fwd = primitive(self.fwd_pd)
        self.bwd = None
        self.mem = _Memories({a: self.data for a in (ARG_SRC, ARG_DST, ARG_DIFF_DST,
                                                     ARG_DIFF_SRC)})

    def forward(self, x_ptr, y_ptr):
        execute(self.fwd, self.mem.bind({ARG_SRC: x_ptr, ARG_DST: y_ptr}))

    def _backward_primitive(self):
        if self.bwd is None:
            pd = vp()
            ok(lib().dnnl_softmax_backward_primitive_desc_create(
                ctypes.byref(pd), engine(), SOFTMAX_ACCURATE, self.data, self.data, self.data, 1,
                self.fwd_pd, None), "softmax_backward_primitive_desc_create")
            self.bwd_impl = impl_info(pd)
            self.bwd = primitive(pd)
        return self.bwd

    def backward_is_reference(self):
        """True when oneDNN's backward for this plan is its reference (unvectorised) kernel."""
        self._backward_primitive()
        return self.bwd_impl.startswith("ref")

    def backward(self, y_ptr, dy_ptr, dx_ptr):
        self._backward_primitive()
        execute(self.bwd, self.mem.bind({ARG_DST: y_ptr, ARG_DIFF_DST: dy_ptr,
                                         ARG_DIFF_SRC: dx_ptr}))


class _LayerNorm:
    _FLAGS = USE_SCALE | USE_SHIFT

    def __init__(self, rows, width, eps):
        self.data, self.stat, self.param = md((rows, width), TAG_AB), md((rows,), TAG_A), \
            md((width,), TAG_A)
        self.eps = eps
        self.fwd_pd = vp()
        ok(lib().dnnl_layer_normalization_forward_primitive_desc_create(
            ctypes.byref(self.fwd_pd), engine(), FORWARD_TRAINING, self.data, self.data,
            self.stat, eps, self._FLAGS, None), "layer_normalization_forward_primitive_desc_create")
        self.fwd = primitive(self.fwd_pd)
        self.bwd = None
        descs = {ARG_SRC: self.data, ARG_DST: self.data, ARG_DIFF_DST: self.data,
                 ARG_DIFF_SRC: self.data, ARG_MEAN: self.stat, ARG_VARIANCE: self.stat,
                 ARG_SCALE: self.param, ARG_SHIFT: self.param, ARG_DIFF_SCALE: self.param,
                 ARG_DIFF_SHIFT: self.param}
        self.mem = _Memories(descs)

    def forward(self, x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, var_ptr):
        execute(self.fwd, self.mem.bind({ARG_SRC: x_ptr, ARG_SCALE: w_ptr, ARG_SHIFT: b_ptr,
                                         ARG_DST: y_ptr, ARG_MEAN: mean_ptr,
                                         ARG_VARIANCE: var_ptr}))

    def backward(self, x_ptr, w_ptr, b_ptr, mean_ptr, var_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr):
        if self.bwd is None:
            pd = vp()
            ok(lib().dnnl_layer_normalization_backward_primitive_desc_create(
                ctypes.byref(pd), engine(), BACKWARD, self.data, self.data, self.data, self.stat,
                self.eps, self._FLAGS, self.fwd_pd, None),
                "layer_normalization_backward_primitive_desc_create")
            self.bwd = primitive(pd)
        execute(self.bwd, self.mem.bind({
            ARG_SRC: x_ptr, ARG_MEAN: mean_ptr, ARG_VARIANCE: var_ptr, ARG_DIFF_DST: dy_ptr,
            ARG_SCALE: w_ptr, ARG_SHIFT: b_ptr, ARG_DIFF_SRC: dx_ptr, ARG_DIFF_SCALE: dw_ptr,
            ARG_DIFF_SHIFT: db_ptr}))


def softmax_plan(rows, width):
    """The softmax plan of [rows, width] (softmax over each row)."""
    key = (_Softmax, int(rows), int(width))
    if key not in _plans:
        _plans[key] = _Softmax(rows, width)
    return _plans[key]


def layer_norm_plan(rows, width, eps):
    """The LayerNorm plan of [rows, width] with scale and shift of [width]."""
    key = (_LayerNorm, int(rows), int(width), float(eps))
    if key not in _plans:
        _plans[key] = _LayerNorm(rows, width, float(eps))
    return _plans[key]
