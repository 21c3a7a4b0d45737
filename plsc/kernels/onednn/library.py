"""Paddle's bundled oneDNN 3 (``paddle/libs/libdnnl.so.3``) through ctypes: loading, the C
enums this package speaks (checked against the library's own ``dnnl_*2str`` at load), memory
descriptors and objects on the tensors' own memory, reorders and execution on one CPU stream.

`plsc.kernels.onednn.conv` and `plsc.kernels.onednn.rows` build their primitives from these pieces."""
import ctypes
import mmap
import os

import numpy as np

__all__ = ["available", "version", "lib", "engine", "ok", "md", "memory", "set_handle", "bind",
           "primitive", "reorder", "execute", "Arg", "Scratch", "SCRATCH", "dims", "vp", "dims_t", "F32"]

# Values of oneDNN 3.x's C enums (dnnl_types.h / dnnl_common_types.h), checked against the
# library's own dnnl_*2str at load (`_check_enums`).
F32 = 3
TAG_ANY, TAG_A, TAG_ABCD, TAG_ABCDE = 1, 2, 5, 6
TAG_ABCD16B = 78  # aBcd16b: NCHW with the channels in blocks of 16 (nChw16c)
TAG_ABCD8B = 102  # aBcd8b: NCHW with the channels in blocks of 8 (nChw8c)
FORWARD_TRAINING, BACKWARD_DATA, BACKWARD_WEIGHTS = 64, 160, 192
CONVOLUTION_DIRECT = 1
SOFTMAX_ACCURATE = 0x30000
ELTWISE_CLIP_V2, ELTWISE_CLIP_V2_USE_DST = 0x2f, 0x106
BACKWARD = 128
TAG_AB = 3
USE_GLOBAL_STATS, USE_SCALE, USE_SHIFT = 0x1, 0x2, 0x4  # normalization flags
FORWARD_INFERENCE = 96
ARG_MEAN, ARG_VARIANCE, ARG_SCALE, ARG_SHIFT = 49, 50, 51, 52
ARG_DIFF_SCALE, ARG_DIFF_SHIFT = 255, 256
CPU_ENGINE = 1
QUERY_SRC, QUERY_DIFF_SRC, QUERY_WEIGHTS, QUERY_DIFF_WEIGHTS = 129, 130, 131, 132
QUERY_DST, QUERY_DIFF_DST = 133, 134
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_BIAS = 1, 17, 33, 41
ARG_DIFF_SRC, ARG_DIFF_DST, ARG_DIFF_WEIGHTS, ARG_DIFF_BIAS = 129, 145, 161, 169
ARG_FROM, ARG_TO = 1, 17  # a reorder's source and destination
MAX_DIMS = 12

dims_t = ctypes.c_int64 * MAX_DIMS
vp = ctypes.c_void_p


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", vp)]


_lib = None
_engine = None
_stream = None
_load_error = None


def _library_path():
    import paddle
    return os.path.join(os.path.dirname(paddle.__file__), "libs", "libdnnl.so.3")


def _declare(lib):
    sigs = {
        "dnnl_engine_create": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_size_t],
        "dnnl_stream_create": [ctypes.POINTER(vp), vp, ctypes.c_uint],
        "dnnl_stream_wait": [vp],
        "dnnl_memory_desc_create_with_tag": [ctypes.POINTER(vp), ctypes.c_int, dims_t,
                                             ctypes.c_int, ctypes.c_int],
        "dnnl_memory_desc_destroy": [vp],
        "dnnl_memory_desc_equal": [vp, vp],
        "dnnl_memory_desc_get_size": [vp],
        "dnnl_memory_create": [ctypes.POINTER(vp), vp, vp, vp],
        "dnnl_memory_set_data_handle": [vp, vp],
        "dnnl_convolution_forward_primitive_desc_create": [
            ctypes.POINTER(vp), vp, ctypes.c_int, ctypes.c_int, vp, vp, vp, vp,
            dims_t, dims_t, dims_t, dims_t, vp],
        "dnnl_convolution_backward_data_primitive_desc_create": [
            ctypes.POINTER(vp), vp, ctypes.c_int, vp, vp, vp,
            dims_t, dims_t, dims_t, dims_t, vp, vp],
        "dnnl_convolution_backward_weights_primitive_desc_create": [
            ctypes.POINTER(vp), vp, ctypes.c_int, vp, vp, vp, vp,
            dims_t, dims_t, dims_t, dims_t, vp, vp],
        "dnnl_softmax_forward_primitive_desc_create": [
            ctypes.POINTER(vp), vp, ctypes.c_int, ctypes.c_int, vp, vp, ctypes.c_int, vp],
        "dnnl_softmax_backward_primitive_desc_create": [
            ctypes.POINTER(vp), vp, ctypes.c_int, vp, vp, vp, ctypes.c_int, vp, vp],
        "dnnl_layer_normalization_forward_primitive_desc_create": [
            ctypes.POINTER(vp), vp, ctypes.c_int, vp, vp, vp, ctypes.c_float, ctypes.c_uint, vp],
        "dnnl_layer_normalization_backward_primitive_desc_create": [
            ctypes.POINTER(vp), vp, ctypes.c_int, vp, vp, vp, vp, ctypes.c_float, ctypes.c_uint,
            vp, vp],
        "dnnl_batch_normalization_forward_primitive_desc_create": [
            ctypes.POINTER(vp), vp, ctypes.c_int, vp, vp, ctypes.c_float, ctypes.c_uint, vp],
        "dnnl_batch_normalization_backward_primitive_desc_create": [
            ctypes.POINTER(vp), vp, ctypes.c_int, vp, vp, vp, ctypes.c_float, ctypes.c_uint,
            vp, vp],
        "dnnl_eltwise_forward_primitive_desc_create": [
            ctypes.POINTER(vp), vp, ctypes.c_int, ctypes.c_int, vp, vp, ctypes.c_float,
            ctypes.c_float, vp],
        "dnnl_eltwise_backward_primitive_desc_create": [
            ctypes.POINTER(vp), vp, ctypes.c_int, vp, vp, vp, ctypes.c_float, ctypes.c_float,
            vp, vp],
        "dnnl_prelu_forward_primitive_desc_create": [
            ctypes.POINTER(vp), vp, ctypes.c_int, vp, vp, vp, vp],
        "dnnl_prelu_backward_primitive_desc_create": [
            ctypes.POINTER(vp), vp, vp, vp, vp, vp, vp, vp, vp],
        "dnnl_reorder_primitive_desc_create": [ctypes.POINTER(vp), vp, vp, vp, vp, vp],
        "dnnl_primitive_desc_query_md": [vp, ctypes.c_int, ctypes.c_int],
        "dnnl_primitive_desc_query": [vp, ctypes.c_int, ctypes.c_int, vp],
        "dnnl_primitive_create": [ctypes.POINTER(vp), vp],
        "dnnl_primitive_execute": [vp, vp, ctypes.c_int, ctypes.POINTER(_ExecArg)],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
    lib.dnnl_primitive_desc_query_md.restype = vp
    for name in ("dnnl_fmt_tag2str", "dnnl_prop_kind2str", "dnnl_alg_kind2str", "dnnl_dt2str"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = [ctypes.c_int]


def _check_enums(lib):
    expected = [("dnnl_dt2str", F32, b"f32"), ("dnnl_fmt_tag2str", TAG_ANY, b"any"),
                ("dnnl_fmt_tag2str", TAG_A, b"a"), ("dnnl_fmt_tag2str", TAG_ABCD, b"abcd"),
                ("dnnl_fmt_tag2str", TAG_ABCDE, b"abcde"),
                ("dnnl_fmt_tag2str", TAG_ABCD16B, b"aBcd16b"),
                ("dnnl_fmt_tag2str", TAG_ABCD8B, b"aBcd8b"), ("dnnl_fmt_tag2str", TAG_AB, b"ab"),
                ("dnnl_prop_kind2str", BACKWARD, b"backward"),
                ("dnnl_alg_kind2str", SOFTMAX_ACCURATE, b"softmax_accurate"),
                ("dnnl_alg_kind2str", ELTWISE_CLIP_V2, b"eltwise_clip_v2"),
                ("dnnl_alg_kind2str", ELTWISE_CLIP_V2_USE_DST,
                 b"eltwise_clip_v2_use_dst_for_bwd"),
                ("dnnl_prop_kind2str", FORWARD_TRAINING, b"forward_training"),
                ("dnnl_prop_kind2str", FORWARD_INFERENCE, b"forward_inference"),
                ("dnnl_prop_kind2str", BACKWARD_DATA, b"backward_data"),
                ("dnnl_prop_kind2str", BACKWARD_WEIGHTS, b"backward_weights"),
                ("dnnl_alg_kind2str", CONVOLUTION_DIRECT, b"convolution_direct")]
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
        engine, stream = vp(), vp()
        ok(lib.dnnl_engine_create(ctypes.byref(engine), CPU_ENGINE, 0), "engine_create")
        ok(lib.dnnl_stream_create(ctypes.byref(stream), engine, 1), "stream_create")
    except (OSError, AttributeError) as exc:
        _load_error = exc
        return None
    _lib, _engine, _stream = lib, engine, stream
    return _lib


def ok(status, what):
    if status != 0:
        raise RuntimeError(f"oneDNN {what} failed with status {status}")


def lib():
    """The loaded library (call `available` first: None when it did not load)."""
    return _load()


def engine():
    """The CPU engine every primitive runs on."""
    _load()
    return _engine


def available():
    """True when Paddle's bundled oneDNN 3.x loaded."""
    return _load() is not None


def version():
    """"major.minor.patch" of the loaded oneDNN, or None."""
    if _load() is None:
        return None
    v = _lib.dnnl_version().contents
    return f"{v.major}.{v.minor}.{v.patch}"


def dims(values):
    d = dims_t()
    for i, v in enumerate(values):
        d[i] = int(v)
    return d


def md(shape, tag):
    md = vp()
    if _load() is None:
        raise RuntimeError(f"oneDNN is not available: {_load_error}")
    ok(_lib.dnnl_memory_desc_create_with_tag(ctypes.byref(md), len(shape), dims(shape), F32,
                                              tag), "memory_desc_create")
    return md


class Scratch:
    """Buffers of the blocked layouts a primitive reads or writes, shared by every plan: one per
    slot (a name), grown to the largest size asked of it and kept until `release` (the
    trainer releases them after each evaluation, whose larger batch grew them).

    A plan's arguments are staged into these only for the duration of one call (reorder in,
    execute, reorder out), and the calls run one at a time, so the plans of a whole network
    need no more than a few buffers of its largest activation (before, each plan kept one per
    argument for the process: 2.8 GB at IResNet18's 112 px and batch 32, see
    docs/performance.md). Not thread-safe: a process's oneDNN calls run on one thread."""

    def __init__(self):
        self._buffers = {}

    def address(self, slot, nbytes):
        """The address of slot `slot`'s buffer of at least `nbytes` bytes (page-aligned)."""
        held = self._buffers.get(slot)
        if held is None or len(held[0]) < nbytes:
            if held is not None:
                held[0].close()  # the old one goes before the larger one is taken
            # a private mapping of its own, not malloc's heap: a long-lived block taken in the
            # middle of a step's tensors would split the heap around it (docs/performance.md)
            buf = mmap.mmap(-1, max(1, -(-int(nbytes) // 4096)) * 4096,
                            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            view = ctypes.c_char.from_buffer(buf)
            held = self._buffers[slot] = (buf, ctypes.addressof(view))
            del view  # no export left: the mapping can be closed
        return held[1]

    def held(self, slot):
        """Bytes slot `slot` holds now (0 before its first use)."""
        return len(self._buffers[slot][0]) if slot in self._buffers else 0

    def nbytes(self):
        """Bytes held by every slot."""
        return sum(len(buf) for buf, _ in self._buffers.values())

    def release(self):
        """Unmap every buffer (the next call maps them again)."""
        for buf, _ in self._buffers.values():
            buf.close()
        self._buffers.clear()


SCRATCH = Scratch()


class Arg:
    """One argument of a primitive: the plain layout Paddle holds, the one the primitive
    wants, and when they differ the reorder between them and the `SCRATCH` slot that holds the
    latter during a call."""

    def __init__(self, plain, wanted, to_wanted, slot):
        self.plain = plain
        self.wanted = wanted
        self.slot = slot
        self.same = bool(_lib.dnnl_memory_desc_equal(plain, wanted))
        self.memory = memory(wanted)
        self.nbytes = 0
        self.reorder = None
        self.plain_memory = None
        self.staged = None  # the address the primitive reads, after `stage_in`
        if not self.same:
            self.nbytes = _lib.dnnl_memory_desc_get_size(wanted)
            self.plain_memory = memory(plain)
            src, dst = (plain, wanted) if to_wanted else (wanted, plain)
            self.reorder = reorder(src, dst)

    def stage_in(self, ptr, staged_by=None):
        """Point the primitive's memory at the plain data `ptr`, reordering it if needed; when
        `staged_by` (another primitive's `Arg` of the same data, staged in this same call) already
        holds it in the layout this one wants, read that instead of reordering again."""
        reordered = False
        if self.same:
            self.staged = ptr
        elif staged_by is not None and _lib.dnnl_memory_desc_equal(self.wanted, staged_by.wanted):
            self.staged = staged_by.staged
        else:
            self.staged = SCRATCH.address(self.slot, self.nbytes)
            set_handle(self.plain_memory, ptr)
            reordered = True
        set_handle(self.memory, self.staged)
        if reordered:
            execute(self.reorder, ((ARG_FROM, self.plain_memory), (ARG_TO, self.memory)))

    def bind_out(self, ptr):
        """Point the primitive's output memory at `ptr`, or at its scratch slot when the result
        is reordered into `ptr` afterwards (`stage_out`)."""
        set_handle(self.memory, ptr if self.same else SCRATCH.address(self.slot, self.nbytes))

    def stage_out(self, ptr):
        """Copy the primitive's output into the plain data at `ptr` when it was reordered."""
        if not self.same:
            set_handle(self.plain_memory, ptr)
            execute(self.reorder, ((ARG_FROM, self.memory), (ARG_TO, self.plain_memory)))


def memory(md):
    mem = vp()
    ok(_lib.dnnl_memory_create(ctypes.byref(mem), md, _engine, None), "memory_create")
    return mem


def set_handle(mem, ptr):
    ok(_lib.dnnl_memory_set_data_handle(mem, vp(ptr)), "memory_set_data_handle")


def bind(memories, ptrs):
    """Point each role's memory (`memories[role]`) at its address in `ptrs` ({role: address});
    the (role, memory) pairs `execute` takes."""
    for role, ptr in ptrs.items():
        set_handle(memories[role], ptr)
    return [(role, memories[role]) for role in ptrs]


QUERY_IMPL_INFO_STR = 8  # dnnl_query_impl_info_str


def impl_info(pd):
    """The implementation oneDNN chose for primitive descriptor `pd` ("jit:avx2",
    "ref:any", ...): its ONEDNN_VERBOSE name."""
    name = ctypes.c_char_p()
    ok(_lib.dnnl_primitive_desc_query(pd, QUERY_IMPL_INFO_STR, 0, ctypes.byref(name)),
       "primitive_desc_query(impl_info_str)")
    return name.value.decode()


def primitive(pd):
    prim = vp()
    ok(_lib.dnnl_primitive_create(ctypes.byref(prim), pd), "primitive_create")
    return prim


def reorder(src, dst):
    pd = vp()
    ok(_lib.dnnl_reorder_primitive_desc_create(ctypes.byref(pd), src, _engine, dst, _engine,
                                                None), "reorder_primitive_desc_create")
    return primitive(pd)


def execute(prim, args):
    array = (_ExecArg * len(args))(*[_ExecArg(a, m) for a, m in args])
    ok(_lib.dnnl_primitive_execute(prim, _stream, len(args), array), "primitive_execute")
    ok(_lib.dnnl_stream_wait(_stream), "stream_wait")


