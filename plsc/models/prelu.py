"""PReLU whose CPU kernels are several times faster than Paddle 3.3's, with the same results.

Paddle 3.3's CPU prelu is a scalar loop on one thread, a large share of an IResNet training step
on the CPU (timings: docs/performance.md, "plsc's own CPU kernels, measured"). Here, on float32
CPU tensors whose slopes all lie in [0, 1] (the init is 0.25), the work is done by numpy on the
tensors' own memory (DLPack, no copy), in slabs of rows that stay in cache, split over the
rank's CPU threads:

    forward   y = max(x, a·x)                       (= x if x > 0 else a·x, for 0 ≤ a ≤ 1)
    backward  dx = g·s,  s = max([x > 0], a)         (s is exactly 1 or a for 0 ≤ a ≤ 1)
              da = Σ g·min(x, 0)   over batch and space, per channel

`y` and `dx` equal Paddle's kernel bit for bit; `da` is the same sum in another order (each
row of the flattened [N·C, H·W] input is summed whole by one thread, then the rows in a fixed
order, so it does not depend on the thread count). Other inputs (other devices, 16-bit,
channels-last, a slope outside [0, 1]) and static graphs (export) use
`paddle.nn.functional.prelu`.
"""
import functools

import numpy as np
import paddle
from paddle import nn
from paddle.autograd import PyLayer

from . import blocked
from ..kernels.cpu_kernels import applies, as_numpy, run_rows

__all__ = ["PReLU", "prelu"]

_SLAB = 64 << 10  # floats per slab (256 KiB): a slab's temporaries stay in the core's L2


def _rows(t, lanes):
    """`t` ([N, C, ...]) as a numpy [N·C, rest] view of its memory; a blocked activation
    (`lanes`: [N, C/B, H, W, B], `plsc.models.blocked`) as [N·C/B, H·W, B]."""
    if lanes:
        return as_numpy(t).reshape(t.shape[0] * t.shape[1], -1, t.shape[-1])
    return as_numpy(t).reshape(t.shape[0] * t.shape[1], -1)


def _run(fn, rows, group=1):
    """fn(lo, hi, tmp) over slabs of whole rows of `rows`; tmp: a float32 scratch shaped as
    rows[lo:hi]. With `group`, a slab is whole groups of `group` rows or lies within one
    group (its row count then divides `group`)."""
    rest = rows.shape[1:]
    step = max(1, _SLAB // max(1, int(np.prod(rest))))
    step = step - step % group if step >= group else max(
        d for d in range(1, step + 1) if group % d == 0)

    def slab(lo, hi):
        fn(lo, hi, np.empty((hi - lo,) + rest, np.float32))
    run_rows(slab, rows.shape[0], step)


@functools.lru_cache(maxsize=8)
def _zeros(*shape):
    """A read-only float32 zero slab: numpy compares with an array several times faster than
    with a scalar (2.4: 12 against 24 µs a 256 KiB slab)."""
    out = np.zeros(shape, np.float32)
    out.flags.writeable = False
    return out


def _row_slopes(slope, x, lanes):
    """The slopes of every row of `_rows(x, lanes)`, shaped to broadcast against it: per
    channel, or the one shared slope. A blocked `x` gets `_Lanes`."""
    a = slope.numpy().astype(np.float32).reshape(-1)
    if lanes:
        return _Lanes(a, x)
    return np.tile(a if a.size == x.shape[1] else np.repeat(a, x.shape[1]), x.shape[0])[:, None]


class _Lanes:
    """The slopes of a blocked activation as one sample's worth of them, written out
    ([C/B, H·W, B], contiguous): numpy broadcasts it over whole samples with long inner loops,
    where slopes shaped [rows, 1, B] gave it loops of B floats (3.11 against 1.28 ms for
    IResNetTiny's stem, [64, 2, 56·56, 8] under the AVX2 cap)."""

    def __init__(self, a, x):
        b = x.shape[-1]  # channels a block holds
        self.group = x.shape[1]  # rows of one sample
        a = np.broadcast_to(a, (self.group * b,)).reshape(self.group, 1, b)
        self.pattern = np.ascontiguousarray(
            np.broadcast_to(a, (self.group, _rows(x, True).shape[1], b)))

    def at(self, lo, hi):
        """The shape rows[lo:hi] take to broadcast against their slopes, and those slopes:
        whole samples as [k, C/B, H·W, B], rows of one sample as [1, hi-lo, H·W, B]."""
        g = self.group
        if lo % g == 0 and (hi - lo) % g == 0:
            return (-1,) + self.pattern.shape, self.pattern
        return (1, hi - lo) + self.pattern.shape[1:], self.pattern[lo % g:lo % g + hi - lo]


class _FastPReLU(PyLayer):
    @staticmethod
    def forward(ctx, x, slope, lanes):
        out = paddle.empty(x.shape, dtype=x.dtype)
        xr, yr, a = _rows(x, lanes), _rows(out, lanes), _row_slopes(slope, x, lanes)

        def fwd(lo, hi, _):
            shape, slopes = a.at(lo, hi) if lanes else (xr[lo:hi].shape, a[lo:hi])
            xs, ys = xr[lo:hi].reshape(shape), yr[lo:hi].reshape(shape)
            np.multiply(xs, slopes, out=ys)
            np.maximum(ys, xs, out=ys)
        _run(fwd, xr, a.group if lanes else 1)
        ctx.save_for_backward(x, slope)
        ctx.lanes = lanes
        return out

    @staticmethod
    def backward(ctx, grad):
        x, slope = ctx.saved_tensor()
        d_x = paddle.empty(x.shape, dtype=x.dtype)
        lanes = ctx.lanes
        xr, gr, dr = _rows(x, lanes), _rows(grad, lanes), _rows(d_x, lanes)
        a = _row_slopes(slope, x, lanes)
        row_sums = np.empty(xr.shape[:1] + xr.shape[2:], np.float32)  # a row's (lanes') sums
        sums = "ri,ri->r" if xr.ndim == 2 else "rpl,rpl->rl"

        def bwd(lo, hi, tmp):
            xs, gs = xr[lo:hi], gr[lo:hi]
            np.greater(xs, np.float32(0), out=tmp, casting="unsafe")
            shape, slopes = a.at(lo, hi) if lanes else (tmp.shape, a[lo:hi])
            t = tmp.reshape(shape)
            np.maximum(t, slopes, out=t)  # 1 where x > 0, else a
            np.multiply(gs.reshape(shape), t, out=dr[lo:hi].reshape(shape))
            np.minimum(xs, _zeros(*tmp.shape), out=tmp)
            np.einsum(sums, gs, tmp, out=row_sums[lo:hi])
        _run(bwd, xr, a.group if lanes else 1)
        per_channel = row_sums.reshape(x.shape[0], -1).sum(axis=0)
        d_slope = per_channel if slope.size > 1 else per_channel.sum(keepdims=True)
        return d_x, paddle.to_tensor(d_slope.reshape(slope.shape), dtype=slope.dtype)


def _fast_ok(x, slope, data_format):
    if not (paddle.in_dynamic_mode() and applies(x, slope) and x.ndim >= 2
            and data_format in ("NCHW", "NCL", "NC", "NCDHW")):
        return False
    a = slope.numpy()
    return bool(np.all((a >= 0) & (a <= 1)))


def prelu(x, slope, data_format="NCHW"):
    """`paddle.nn.functional.prelu(x, slope, data_format)`, on the fast CPU kernels when they
    apply (see the module's docstring); a blocked activation (`plsc.models.blocked`, NCHW)
    stays blocked."""
    lanes = data_format == "NCHW" and blocked.is_blocked(x)
    if _fast_ok(x, slope, data_format):
        return _FastPReLU.apply(x if x.is_contiguous() else x.contiguous(), slope, lanes)
    if lanes:
        return blocked.to_blocked(paddle.nn.functional.prelu(blocked.to_plain(x), slope))
    return paddle.nn.functional.prelu(x, slope, data_format=data_format)


class PReLU(nn.PReLU):
    """`paddle.nn.PReLU` (same parameter, same state_dict key `weight`) on `prelu`'s kernels."""

    def forward(self, x):
        return prelu(x, self._weight, self._data_format)
