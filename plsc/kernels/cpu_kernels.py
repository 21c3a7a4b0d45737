"""numpy kernels on Paddle's own CPU tensors, where Paddle 3.3's CPU kernels are slow.

A float32 CPU tensor is viewed as a numpy array through DLPack (no copy) and the work is split
by whole rows over the rank's kernel threads (`set_threads`, called by
`plsc.process.cpu_setup.apply`; numpy releases
the GIL in its loops). A row is always computed whole by one call, so results do not depend on
the thread count or on how the rows were sliced. The functions ending in `_` work in place and
need a contiguous tensor. Every other tensor (other devices, other dtypes, strided views) goes
to Paddle's own ops, so callers stay device-agnostic.

Measured speed-ups against Paddle's CPU kernels: docs/performance.md ("plsc's own CPU kernels,
measured").
"""
import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import paddle

from .names import KERNELS_ENV, kernel_set  # noqa: F401  (KERNELS_ENV: the tests' import)
from .numerics import DEVICE_SLAB_BYTES  # the device set's slab budget

__all__ = ["KERNELS_ENV", "kernel_set", "cpu_set", "set_threads", "threads", "applies",
           "softmax_grad",
           "as_numpy", "run_rows", "run_split", "device_slab_rows", "DEVICE_SLAB_BYTES",
           "row_dot", "scale_columns_", "copy_columns", "put_columns_",
           "row_max", "exp_shifted_", "remove_row_components_", "take_rows", "all_finite",
           "finite_flag"]

_SLAB_FLOATS = 1 << 16  # floats of a slab of rows (256 KiB: the passes of one slab stay in L2)


_pools = {}
_threads = 1  # threads of these kernels (Paddle's own default is 1)


def cpu_set(*tensors):
    """True when the CPU kernel set serves these tensors: all on the CPU and PLSC_KERNELS is not
    "device". The one place where a tensor's kernel set is chosen; everything else asks here."""
    return kernel_set() != "device" and all(t.place.is_cpu_place() for t in tensors)


def set_threads(n):
    """Run the kernels on `n` threads (`plsc.process.cpu_setup` gives them Paddle's)."""
    global _threads
    _threads = max(1, int(n))


def threads():
    """Threads the kernels run on."""
    return _threads


def applies(*tensors, dtypes=(paddle.float32,)):
    """True when every tensor is a non-empty CPU tensor of one of `dtypes` (float32)."""
    return cpu_set(*tensors) and all(t.dtype in dtypes and t.size > 0 for t in tensors)


def as_numpy(t):
    """A numpy view of the CPU tensor `t`'s memory (a contiguous copy first if `t` is a
    strided view). Writes through the view change the tensor."""
    t = t.detach()
    return np.from_dlpack(t if t.is_contiguous() else t.contiguous())


def run_rows(fn, rows, step):
    """fn(lo, hi) over [0, rows) in slabs of `step` rows, the slabs dealt round-robin to the
    kernel threads."""
    slabs = [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]
    workers = max(1, min(_threads, len(slabs)))

    def part(k):
        for lo, hi in slabs[k::workers]:
            fn(lo, hi)
    if workers == 1:
        part(0)
        return
    pool = _pools.get(workers)
    if pool is None:
        pool = _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="plsc-cpu")
    list(pool.map(part, range(workers)))


_VS_EXP = []  # [MKL's vsExp, or None], looked up at the first use


def run_split(fn, n):
    """fn(lo, hi) over [0, n) in one slab per kernel thread (e.g. a batch's samples)."""
    run_rows(fn, n, max(1, -(-n // _threads)))


def _exp_(a):
    """a = exp(a) in place (`a`: a C-contiguous float32 numpy array): MKL's vsExp from the MKL
    that Paddle's CPU wheel bundles, where there is one, else numpy's exp: faster, and closer to
    the exact value (largest relative error 6.8e-8 against 1.9e-7; timings: docs/performance.md)."""
    if not _VS_EXP:
        _VS_EXP.append(_load_vs_exp())
    if _VS_EXP[0] is None or not a.flags.c_contiguous or a.size >= 1 << 31:
        np.exp(a, out=a)
    else:
        _VS_EXP[0](a.size, a.ctypes.data, a.ctypes.data)


def _load_vs_exp():
    path = os.path.join(os.path.dirname(paddle.__file__), "libs", "libmklml_intel.so")
    try:
        fn = ctypes.CDLL(path).vsExp
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = None, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def device_slab_rows(t):
    """Rows of `t` ([n, ...]) a device-set pass takes at a time (`DEVICE_SLAB_BYTES`)."""
    width = max(1, t.size // max(1, t.shape[0])) if t.ndim > 1 else 1
    return max(1, DEVICE_SLAB_BYTES // (4 * width))


def _step(t):
    return max(1, _SLAB_FLOATS // max(1, t.shape[1]))


def _in_place_ok(buf, *others):
    return applies(buf, *others) and buf.is_contiguous() and buf.ndim == 2


def softmax_grad(y, dy):
    """The gradient of a softmax over the last axis from its float32 output `y` and the
    output's gradient `dy`: y·(dy − Σ y·dy), row by row (a new tensor)."""
    out = paddle.empty(y.shape, dtype=paddle.float32)
    width = int(y.shape[-1])
    rows = int(y.size) // width
    a, g, o = (as_numpy(t).reshape(rows, width) for t in (y, dy, out))

    def grad(lo, hi):
        yy, gg, oo = a[lo:hi], g[lo:hi], o[lo:hi]
        np.multiply(yy, gg, out=oo)
        s = oo.sum(axis=1, keepdims=True)
        np.subtract(gg, s, out=oo)
        np.multiply(oo, yy, out=oo)
    run_rows(grad, rows, max(1, _SLAB_FLOATS // width))
    return out


def row_dot(a, b):
    """`[n]` dot products of the rows of two `[n, d]` tensors (float32)."""
    if not applies(a, b):
        return paddle.einsum("ij,ij->i", a, b)
    out = paddle.empty([a.shape[0]], dtype=paddle.float32)
    x, y, o = as_numpy(a), as_numpy(b), as_numpy(out)

    def dot(lo, hi):
        np.einsum("ij,ij->i", x[lo:hi], y[lo:hi], out=o[lo:hi])
    run_rows(dot, a.shape[0], _step(a))
    return out


def scale_columns_(buf, scale):
    """buf[:, j] *= scale[j] in place (`buf`: [n, m], `scale`: [m]); returns `buf`."""
    if not _in_place_ok(buf, scale):
        return buf.multiply_(scale)
    b, c = as_numpy(buf), as_numpy(scale)
    run_rows(lambda lo, hi: np.multiply(b[lo:hi], c, out=b[lo:hi]), buf.shape[0], _step(buf))
    return buf


def copy_columns(buf, lo, hi, scale=None, out=None):
    """Columns [lo, hi) of `buf` ([n, m]) as a contiguous [n, hi − lo] tensor, each column
    times `scale` ([hi − lo]) when given, in one pass: into `out` when it is such a tensor
    (float32, contiguous), else into a new one; Paddle's ops (a new tensor) on other devices."""
    if not (_in_place_ok(buf) and (scale is None or applies(scale))):
        part = buf[:, lo:hi]
        return part.contiguous() if scale is None else part * scale
    shape = [buf.shape[0], hi - lo]
    if out is None or not (_in_place_ok(out) and out.shape == shape):
        out = paddle.empty(shape, dtype=paddle.float32)
    b, o = as_numpy(buf), as_numpy(out)
    c = None if scale is None else as_numpy(scale)

    def rows(r0, r1):
        if c is None:
            o[r0:r1] = b[r0:r1, lo:hi]
        else:
            np.multiply(b[r0:r1, lo:hi], c, out=o[r0:r1])
    run_rows(rows, buf.shape[0], max(1, _SLAB_FLOATS // (hi - lo)))
    return out


def put_columns_(buf, lo, part):
    """buf[:, lo:lo + m] = part in place (`buf`: [n, w], `part`: [n, m], float32); returns
    `buf`. The inverse of `copy_columns`."""
    if not (_in_place_ok(buf) and applies(part)):
        buf[:, lo:lo + part.shape[1]] = part
        return buf
    b, p = as_numpy(buf), as_numpy(part)
    hi = lo + part.shape[1]

    def rows(r0, r1):
        b[r0:r1, lo:hi] = p[r0:r1]
    run_rows(rows, buf.shape[0], max(1, _SLAB_FLOATS // part.shape[1]))
    return buf


def row_max(buf):
    """`[n]` largest entry of each row of `buf` ([n, m])."""
    if not applies(buf):
        return buf.max(axis=1)
    out = paddle.empty([buf.shape[0]], dtype=paddle.float32)
    b, o = as_numpy(buf), as_numpy(out)
    run_rows(lambda lo, hi: np.max(b[lo:hi], axis=1, out=o[lo:hi]), buf.shape[0], _step(buf))
    return out


def exp_shifted_(buf, shift, running=False, want_sum=True):
    """buf = exp(buf − m) in place, row by row, with m = `shift` ([n]), or with `running` the
    larger of `shift` and the row's own max. Returns (m, the row sums of the new `buf`, or None
    without `want_sum`). One pass over `buf` here; four as Paddle ops."""
    if not _in_place_ok(buf, shift):
        m = paddle.maximum(shift, buf.max(axis=1)) if running else shift
        buf.subtract_(m.unsqueeze(1))
        buf.exp_()
        return m, (buf.sum(axis=1) if want_sum else None)
    m = paddle.empty(shift.shape, dtype=paddle.float32) if running else shift
    total = paddle.empty(shift.shape, dtype=paddle.float32) if want_sum else None
    b, sh, mm = as_numpy(buf), as_numpy(shift), as_numpy(m)
    s = as_numpy(total) if want_sum else None

    def rows(lo, hi):
        part = b[lo:hi]
        if running:
            np.maximum(np.max(part, axis=1), sh[lo:hi], out=mm[lo:hi])
        np.subtract(part, mm[lo:hi, None], out=part)
        _exp_(part)
        if want_sum:
            np.sum(part, axis=1, out=s[lo:hi])
    run_rows(rows, buf.shape[0], _step(buf))
    return m, total


def remove_row_components_(g, w, inv):
    """g_j −= w_j · ((w_j·g_j) · inv_j · inv_j) in place, row by row (`g`, `w`: [n, d],
    `inv`: [n]): with inv = 1/|w|, the part of each row of `g` along its row of `w` removed."""
    if not (_in_place_ok(g, w, inv) and w.is_contiguous()):
        coef = (row_dot(w, g) * inv * inv).unsqueeze(1)
        step = device_slab_rows(g)
        if step >= g.shape[0]:  # the head's slabs (one budget at most) always: five ops
            return g.subtract_(w * coef)
        for i in range(0, g.shape[0], step):
            g[i:i + step].subtract_(w[i:i + step] * coef[i:i + step])
        return g
    gn, wn, iv = as_numpy(g), as_numpy(w), as_numpy(inv)

    def rows(lo, hi):
        gs, ws = gn[lo:hi], wn[lo:hi]
        coef = np.einsum("ij,ij->i", ws, gs)
        coef *= iv[lo:hi]
        coef *= iv[lo:hi]
        gs -= ws * coef[:, None]
    run_rows(rows, g.shape[0], _step(g))
    return g


def take_rows(src, index, out=None):
    """Rows `index` ([k] int64 or int32) of `src` ([n, ...], float32 or int16, e.g. a 16-bit
    array's bits), into `out` when given (a contiguous [k, ...] tensor of `src`'s dtype)."""
    if not (applies(src, dtypes=(paddle.float32, paddle.int16))
            and applies(index, dtypes=(paddle.int64, paddle.int32))
            and src.is_contiguous() and (out is None or out.is_contiguous())):
        return paddle.index_select(src, index, out=out) if out is not None \
            else paddle.gather(src, index)
    if out is None:
        out = paddle.empty([index.shape[0]] + list(src.shape[1:]), dtype=src.dtype)
    s, i, o = as_numpy(src), as_numpy(index), as_numpy(out)
    if i.size and (i.min() < 0 or i.max() >= s.shape[0]):
        raise IndexError(f"row index out of range [0, {s.shape[0]}): {i.min()} .. {i.max()}")
    width = max(1, int(np.prod(s.shape[1:])))
    run_rows(lambda lo, hi: np.take(s, i[lo:hi], axis=0, out=o[lo:hi], mode="clip"),
             index.shape[0], max(1, _SLAB_FLOATS // width))
    return out


def all_finite(*tensors):
    """Whether every element of the given tensors (None: skipped) is finite, as a Python bool.
    A float32 CPU tensor is checked in slabs of its memory; any other is checked with Paddle's
    ops and read back (on a GPU that read waits for the device)."""
    for t in tensors:
        if t is None or t.size == 0:
            continue
        if not applies(t) or not t.is_contiguous():
            if not bool(paddle.isfinite(t).all()):
                return False
            continue
        a = as_numpy(t).reshape([-1, t.shape[-1] if t.ndim else 1])
        bad = []
        run_rows(lambda lo, hi: bad.append(not np.isfinite(a[lo:hi]).all()), a.shape[0],
                 max(1, _SLAB_FLOATS // max(1, a.shape[1])))
        if any(bad):
            return False
    return True


def finite_flag(tensors):
    """A 0-d bool tensor: every tensor (None: skipped) is free of inf and NaN. On the CPU the
    check runs on the tensors' memory; elsewhere it stays on the device (nothing is read)."""
    tensors = [t for t in tensors if t is not None]
    if cpu_set(*tensors):
        return paddle.full([], all_finite(*tensors), dtype="bool")  # not to_tensor: it leaks a list
    flags = [paddle.isfinite(t).all() for t in tensors]
    if len(flags) == 1:
        return flags[0]
    return paddle.stack(flags).all() if flags else paddle.full([], True, dtype="bool")
