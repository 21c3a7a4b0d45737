"""Convolutions through the oneDNN library that Paddle's CPU wheel bundles, on Paddle's tensors.

Paddle 3.3's own CPU `conv2d` and its gradients lower to im2col and a GEMM; oneDNN (bundled as
``paddle/libs/libdnnl.so.3``, the library torch's CPU convolutions run on too) has direct
kernels for blocked layouts. `conv2d` here runs the forward pass, the gradient of the input
and the gradient of the weights as oneDNN primitives on the tensors' own memory (through
ctypes; no copy of a plain NCHW tensor), each primitive choosing its layout: a plain input is
reordered into that layout and the result back, both by oneDNN.

One `_Plan` per convolution geometry (shapes, stride, padding, dilation, groups, bias) holds
the primitives and the scratch buffers of the blocked layouts; plans are built on first use
and kept for the process. oneDNN runs on the OpenMP threads Paddle runs on.

`available()` says whether the library loaded (the version this module speaks is oneDNN 3.x's
C API); `applies` whether a call can take it: float32 CPU tensors under the CPU kernel set
(`plsc.cpu_kernels.cpu_set`). Everything else goes to Paddle's `conv2d`
(`plsc.models.conv`).
"""
import ctypes
import os

import numpy as np

__all__ = ["available", "version", "conv_forward", "conv_backward", "plan_count"]

# Values of oneDNN 3.x's C enums (dnnl_types.h / dnnl_common_types.h), checked against the
# library's own dnnl_*2str at load (`_check_enums`).
_F32 = 3
_TAG_ANY, _TAG_A, _TAG_ABCD, _TAG_ABCDE = 1, 2, 5, 6
_FORWARD_TRAINING, _BACKWARD_DATA, _BACKWARD_WEIGHTS = 64, 160, 192
_CONVOLUTION_DIRECT = 1
_CPU_ENGINE = 1
_QUERY_SRC, _QUERY_DIFF_SRC, _QUERY_WEIGHTS, _QUERY_DIFF_WEIGHTS = 129, 130, 131, 132
_QUERY_DST, _QUERY_DIFF_DST = 133, 134
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS, _ARG_BIAS = 1, 17, 33, 41
_ARG_DIFF_SRC, _ARG_DIFF_DST, _ARG_DIFF_WEIGHTS, _ARG_DIFF_BIAS = 129, 145, 161, 169
_ARG_FROM, _ARG_TO = 1, 17  # a reorder's source and destination
_MAX_DIMS = 12

_dims_t = ctypes.c_int64 * _MAX_DIMS
_vp = ctypes.c_void_p


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _vp)]


_lib = None
_engine = None
_stream = None
_load_error = None
_plans = {}


def _library_path():
    import paddle
    return os.path.join(os.path.dirname(paddle.__file__), "libs", "libdnnl.so.3")


def _declare(lib):
    sigs = {
        "dnnl_engine_create": [ctypes.POINTER(_vp), ctypes.c_int, ctypes.c_size_t],
        "dnnl_stream_create": [ctypes.POINTER(_vp), _vp, ctypes.c_uint],
        "dnnl_stream_wait": [_vp],
        "dnnl_memory_desc_create_with_tag": [ctypes.POINTER(_vp), ctypes.c_int, _dims_t,
                                             ctypes.c_int, ctypes.c_int],
        "dnnl_memory_desc_destroy": [_vp],
        "dnnl_memory_desc_equal": [_vp, _vp],
        "dnnl_memory_desc_get_size": [_vp],
        "dnnl_memory_create": [ctypes.POINTER(_vp), _vp, _vp, _vp],
        "dnnl_memory_set_data_handle": [_vp, _vp],
        "dnnl_convolution_forward_primitive_desc_create": [
            ctypes.POINTER(_vp), _vp, ctypes.c_int, ctypes.c_int, _vp, _vp, _vp, _vp,
            _dims_t, _dims_t, _dims_t, _dims_t, _vp],
        "dnnl_convolution_backward_data_primitive_desc_create": [
            ctypes.POINTER(_vp), _vp, ctypes.c_int, _vp, _vp, _vp,
            _dims_t, _dims_t, _dims_t, _dims_t, _vp, _vp],
        "dnnl_convolution_backward_weights_primitive_desc_create": [
            ctypes.POINTER(_vp), _vp, ctypes.c_int, _vp, _vp, _vp, _vp,
            _dims_t, _dims_t, _dims_t, _dims_t, _vp, _vp],
        "dnnl_reorder_primitive_desc_create": [ctypes.POINTER(_vp), _vp, _vp, _vp, _vp, _vp],
        "dnnl_primitive_desc_query_md": [_vp, ctypes.c_int, ctypes.c_int],
        "dnnl_primitive_create": [ctypes.POINTER(_vp), _vp],
        "dnnl_primitive_execute": [_vp, _vp, ctypes.c_int, ctypes.POINTER(_ExecArg)],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
    lib.dnnl_primitive_desc_query_md.restype = _vp
    for name in ("dnnl_fmt_tag2str", "dnnl_prop_kind2str", "dnnl_alg_kind2str", "dnnl_dt2str"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = [ctypes.c_int]


def _check_enums(lib):
    expected = [("dnnl_dt2str", _F32, b"f32"), ("dnnl_fmt_tag2str", _TAG_ANY, b"any"),
                ("dnnl_fmt_tag2str", _TAG_A, b"a"), ("dnnl_fmt_tag2str", _TAG_ABCD, b"abcd"),
                ("dnnl_fmt_tag2str", _TAG_ABCDE, b"abcde"),
                ("dnnl_prop_kind2str", _FORWARD_TRAINING, b"forward_training"),
                ("dnnl_prop_kind2str", _BACKWARD_DATA, b"backward_data"),
                ("dnnl_prop_kind2str", _BACKWARD_WEIGHTS, b"backward_weights"),
                ("dnnl_alg_kind2str", _CONVOLUTION_DIRECT, b"convolution_direct")]
    for fn, value, name in expected:
        got = getattr(lib, fn)(value)
        if got != name:
            raise OSError(f"{fn}({value}) is {got!r}, expected {name!r}: not oneDNN 3.x's C API")


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                ("gpu_runtime", ctypes.c_uint)]


def _load():
    global _lib, _engine, _stream, _load_error
    if _lib is not None or _load_error is not None:
        return _lib
    try:
        lib = ctypes.CDLL(_library_path())
        lib.dnnl_version.restype = ctypes.POINTER(_Version)
        if lib.dnnl_version().contents.major != 3:
            raise OSError("oneDNN major version is not 3")
        _declare(lib)
        _check_enums(lib)
        engine, stream = _vp(), _vp()
        _ok(lib.dnnl_engine_create(ctypes.byref(engine), _CPU_ENGINE, 0), "engine_create")
        _ok(lib.dnnl_stream_create(ctypes.byref(stream), engine, 1), "stream_create")
    except (OSError, AttributeError) as exc:
        _load_error = exc
        return None
    _lib, _engine, _stream = lib, engine, stream
    return _lib


def _ok(status, what):
    if status != 0:
        raise RuntimeError(f"oneDNN {what} failed with status {status}")


def available():
    """True when Paddle's bundled oneDNN 3.x loaded."""
    return _load() is not None


def version():
    """"major.minor.patch" of the loaded oneDNN, or None."""
    if _load() is None:
        return None
    v = _lib.dnnl_version().contents
    return f"{v.major}.{v.minor}.{v.patch}"


def _dims(values):
    d = _dims_t()
    for i, v in enumerate(values):
        d[i] = int(v)
    return d


def _md(shape, tag):
    md = _vp()
    _ok(_lib.dnnl_memory_desc_create_with_tag(ctypes.byref(md), len(shape), _dims(shape), _F32,
                                              tag), "memory_desc_create")
    return md


class _Arg:
    """One argument of a primitive: the plain layout Paddle holds, the one the primitive
    wants, and when they differ the reorder between them and a scratch buffer of the latter."""

    def __init__(self, plain, wanted, to_wanted):
        self.plain = plain
        self.wanted = wanted
        self.same = bool(_lib.dnnl_memory_desc_equal(plain, wanted))
        self.memory = _memory(wanted)
        self.buffer = None
        self.reorder = None
        self.plain_memory = None
        self.staged = None  # the address the primitive reads, after `stage_in`
        if not self.same:
            self.buffer = np.empty(_lib.dnnl_memory_desc_get_size(wanted) // 4 + 16, np.float32)
            self.plain_memory = _memory(plain)
            src, dst = (plain, wanted) if to_wanted else (wanted, plain)
            self.reorder = _reorder(src, dst)
            _set(self.memory, self.buffer.ctypes.data)

    def stage_in(self, ptr, staged_by=None):
        """Point the primitive's memory at the plain data `ptr`, reordering it if needed; when
        `staged_by` (another primitive's `_Arg` of the same data) already holds it in the
        layout this one wants, read that instead of reordering again."""
        if self.same:
            self.staged = ptr
        elif staged_by is not None and _lib.dnnl_memory_desc_equal(self.wanted, staged_by.wanted):
            self.staged = staged_by.staged
        else:
            _set(self.plain_memory, ptr)
            _set(self.memory, self.buffer.ctypes.data)
            _execute(self.reorder, ((_ARG_FROM, self.plain_memory), (_ARG_TO, self.memory)))
            self.staged = self.buffer.ctypes.data
        _set(self.memory, self.staged)

    def bind_out(self, ptr):
        """Point the primitive's output memory at `ptr` when no reorder is needed."""
        if self.same:
            _set(self.memory, ptr)

    def stage_out(self, ptr):
        """Copy the primitive's output into the plain data at `ptr` when it was reordered."""
        if not self.same:
            _set(self.plain_memory, ptr)
            _execute(self.reorder, ((_ARG_FROM, self.memory), (_ARG_TO, self.plain_memory)))


def _memory(md):
    mem = _vp()
    _ok(_lib.dnnl_memory_create(ctypes.byref(mem), md, _engine, None), "memory_create")
    return mem


def _set(mem, ptr):
    _ok(_lib.dnnl_memory_set_data_handle(mem, _vp(ptr)), "memory_set_data_handle")


def _primitive(pd):
    prim = _vp()
    _ok(_lib.dnnl_primitive_create(ctypes.byref(prim), pd), "primitive_create")
    return prim


def _reorder(src, dst):
    pd = _vp()
    _ok(_lib.dnnl_reorder_primitive_desc_create(ctypes.byref(pd), src, _engine, dst, _engine,
                                                None), "reorder_primitive_desc_create")
    return _primitive(pd)


def _execute(prim, args):
    array = (_ExecArg * len(args))(*[_ExecArg(a, m) for a, m in args])
    _ok(_lib.dnnl_primitive_execute(prim, _stream, len(args), array), "primitive_execute")
    _ok(_lib.dnnl_stream_wait(_stream), "stream_wait")


class _Plan:
    """The primitives of one convolution geometry: forward, then (on first use) the gradients."""

    def __init__(self, x_shape, w_shape, stride, pad_l, pad_r, dilation, groups, bias):
        n, c, h, w = x_shape
        o, _, kh, kw = w_shape
        oh = (h + pad_l[0] + pad_r[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        ow = (w + pad_l[1] + pad_r[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        self.out_shape = (n, o, oh, ow)
        self.bias = bias
        if groups == 1:
            w_dims, w_tag = w_shape, _TAG_ABCD
        else:
            w_dims, w_tag = (groups, o // groups) + tuple(w_shape[1:]), _TAG_ABCDE
        self.geometry = (_dims(stride), _dims([d - 1 for d in dilation]), _dims(pad_l),
                         _dims(pad_r))
        self.plain = {"src": _md(x_shape, _TAG_ABCD), "weights": _md(w_dims, w_tag),
                      "dst": _md(self.out_shape, _TAG_ABCD)}
        self.any = {"src": _md(x_shape, _TAG_ANY), "weights": _md(w_dims, _TAG_ANY),
                    "dst": _md(self.out_shape, _TAG_ANY)}
        self.bias_md = _md((o,), _TAG_A) if bias else None
        self.fwd_pd = _vp()
        _ok(_lib.dnnl_convolution_forward_primitive_desc_create(
            ctypes.byref(self.fwd_pd), _engine, _FORWARD_TRAINING, _CONVOLUTION_DIRECT,
            self.any["src"], self.any["weights"], self.bias_md, self.any["dst"],
            *self.geometry, None), "convolution_forward_primitive_desc_create")
        self.fwd = _primitive(self.fwd_pd)
        self.fwd_args = self._args(self.fwd_pd, {"src": (_QUERY_SRC, True),
                                                 "weights": (_QUERY_WEIGHTS, True),
                                                 "dst": (_QUERY_DST, False)})
        self.bias_memory = _memory(self.bias_md) if bias else None
        self.bwd_data = None
        self.bwd_weights = None

    def _args(self, pd, roles):
        """{role: _Arg} for (query, is an input) by role name ("diff_" roles use the plain
        layout of the role they are the gradient of)."""
        args = {}
        for role, (query, is_input) in roles.items():
            wanted = _lib.dnnl_primitive_desc_query_md(pd, query, 0)
            args[role] = _Arg(self.plain[role.replace("diff_", "")], wanted, is_input)
        return args

    def _backward_data(self):
        if self.bwd_data is None:
            pd = _vp()
            _ok(_lib.dnnl_convolution_backward_data_primitive_desc_create(
                ctypes.byref(pd), _engine, _CONVOLUTION_DIRECT, self.any["src"],
                self.any["weights"], self.any["dst"], *self.geometry, self.fwd_pd, None),
                "convolution_backward_data_primitive_desc_create")
            self.bwd_data = (_primitive(pd), self._args(pd, {
                "diff_src": (_QUERY_DIFF_SRC, False), "weights": (_QUERY_WEIGHTS, True),
                "diff_dst": (_QUERY_DIFF_DST, True)}))
        return self.bwd_data

    def _backward_weights(self):
        if self.bwd_weights is None:
            pd = _vp()
            _ok(_lib.dnnl_convolution_backward_weights_primitive_desc_create(
                ctypes.byref(pd), _engine, _CONVOLUTION_DIRECT, self.any["src"],
                self.any["weights"], self.bias_md, self.any["dst"], *self.geometry,
                self.fwd_pd, None), "convolution_backward_weights_primitive_desc_create")
            self.bwd_weights = (_primitive(pd), self._args(pd, {
                "src": (_QUERY_SRC, True), "diff_weights": (_QUERY_DIFF_WEIGHTS, False),
                "diff_dst": (_QUERY_DIFF_DST, True)}))
        return self.bwd_weights

    def forward(self, x_ptr, w_ptr, b_ptr, y_ptr):
        args = self.fwd_args
        args["src"].stage_in(x_ptr)
        args["weights"].stage_in(w_ptr)
        args["dst"].bind_out(y_ptr)
        run = [(_ARG_SRC, args["src"].memory), (_ARG_WEIGHTS, args["weights"].memory),
               (_ARG_DST, args["dst"].memory)]
        if self.bias:
            _set(self.bias_memory, b_ptr)
            run.append((_ARG_BIAS, self.bias_memory))
        _execute(self.fwd, run)
        args["dst"].stage_out(y_ptr)

    def backward(self, x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr):
        """The gradients asked for (a None pointer skips that one)."""
        dy_staged = None
        if dx_ptr is not None:
            prim, args = self._backward_data()
            args["weights"].stage_in(w_ptr)
            args["diff_dst"].stage_in(dy_ptr)
            args["diff_src"].bind_out(dx_ptr)
            _execute(prim, [(_ARG_WEIGHTS, args["weights"].memory),
                            (_ARG_DIFF_DST, args["diff_dst"].memory),
                            (_ARG_DIFF_SRC, args["diff_src"].memory)])
            args["diff_src"].stage_out(dx_ptr)
            dy_staged = args["diff_dst"]
        if dw_ptr is not None:
            prim, args = self._backward_weights()
            args["src"].stage_in(x_ptr)
            args["diff_dst"].stage_in(dy_ptr, staged_by=dy_staged)
            args["diff_weights"].bind_out(dw_ptr)
            run = [(_ARG_SRC, args["src"].memory), (_ARG_DIFF_DST, args["diff_dst"].memory),
                   (_ARG_DIFF_WEIGHTS, args["diff_weights"].memory)]
            if self.bias:
                _set(self.bias_memory, db_ptr)
                run.append((_ARG_DIFF_BIAS, self.bias_memory))
            _execute(prim, run)
            args["diff_weights"].stage_out(dw_ptr)


def plan(x_shape, w_shape, stride, pad_l, pad_r, dilation, groups, bias):
    """The `_Plan` of this geometry (built on first use; the library must be `available`)."""
    key = (tuple(x_shape), tuple(w_shape), tuple(stride), tuple(pad_l), tuple(pad_r),
           tuple(dilation), int(groups), bool(bias))
    found = _plans.get(key)
    if found is None:
        found = _plans[key] = _Plan(*key)
    return found


def plan_count():
    """Geometries planned so far in this process."""
    return len(_plans)


def conv_forward(p, x_ptr, w_ptr, b_ptr, y_ptr):
    """y = conv(x, w) (+ b) on plain NCHW float32 memory at the given addresses."""
    p.forward(x_ptr, w_ptr, b_ptr, y_ptr)


def conv_backward(p, x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr):
    """dx, dw (and db) of `conv_forward` for dy; a None address skips that gradient."""
    p.backward(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr)
