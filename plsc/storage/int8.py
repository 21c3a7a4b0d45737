"""8-bit head arrays: one byte per value and one float32 scale per row.

An `Int8Rows` stores `[n, ..., d]` values as codes (one byte each) and a scale per row (the
last axis is the row): value = map(code) · scale, with the scale recomputed from the row's
largest magnitude whenever the row is written. Rows are independent, so writing some rows
leaves every other row bit for bit.

Maps (the storage dtype names, as checkpoints' `head_dtypes` spell them):
- "int8": linear, code c in [-127, 127], value c · scale / 127 with scale = max|x|. Class
  centres and SGD momentum: every value of a row gets the same absolute step, max|x| / 127.
- "int8_log": signed, logarithmic: ±2^(-k/8) for k = 0 … 125 and 0 (code 0), scale =
  max|x|. AdamW's first moment: relative steps of 2^(1/8) (9 %) down to 2^-15.6 of the row's
  largest value.
- "uint8_log": non-negative, logarithmic: 2^(-k/8) for k = 0 … 254 and 0, scale = max|x|.
  AdamW's second moment, whose square root divides the update: relative steps of 9 % over
  2^-31.75 of the row's largest value, and a positive value is never stored as 0 (values
  below the smallest step are stored as it), so no update is divided by 0 + ε.
`benchmarks/benchmark_int8_state.py` measures why the moments are not linear.

Writing (`quantize`) rounds to nearest, or with `noise` (uniform in [0, 1), one per value:
`plsc.optim.rounding.uniform_noise`) stochastically: the upper neighbour `hi` of y = x/scale
with probability (y − lo) / (hi − lo), so the stored value equals x in expectation. Rows with
a NaN or an infinity get a NaN scale (the row reads back as NaN). Reading (`rows`,
`take`) gives float32; every head GEMM and update reads through `plsc.storage`, whatever the
storage dtype (float32 is returned as is, 16 bits upcast exactly, 8 bits dequantised).

On the CPU both directions run as numpy on the tensors' memory, a slab of rows per kernel
thread (`plsc.kernels.cpu_kernels`): the same IEEE operations as the Paddle ops used elsewhere, so the
same bits (tested), several times faster than Paddle 3.3's CPU kernels (docs/performance.md,
"plsc's own CPU kernels, measured").
"""
import numpy as np
import paddle

from ..kernels.cpu_kernels import applies, cpu_set, as_numpy, run_rows, take_rows
from ..dtypes import INT8_MAP_NAMES

__all__ = ["INT8_MAPS", "Int8Rows", "quantize", "dequantize", "record_dtype"]

_LOG_STEPS = 8  # codes an octave of the logarithmic maps
_SLAB_VALUES = 1 << 16  # values of a slab of rows on the CPU path


def _log_table(signed):
    """The float32 values of a logarithmic map's codes, ascending (float64 on the host, then
    rounded once)."""
    if signed:
        mags = 2.0 ** (-np.arange(126, dtype=np.float64) / _LOG_STEPS)  # 1 … 2^-15.6
        values = np.concatenate([-mags, [0.0], mags[::-1]])  # codes -126 … 126
        return values.astype(np.float32), -126
    mags = 2.0 ** (-np.arange(255, dtype=np.float64) / _LOG_STEPS)
    return np.concatenate([[0.0], mags[::-1]]).astype(np.float32), 0  # codes 0 … 255


class _Map:
    """A code ↔ value map: `table` (ascending float32 values of codes first … first+len−1) or
    linear (None); the numpy/Paddle dtype of the codes."""

    def __init__(self, name, table, first, code_dtype):
        self.name, self.table, self.first, self.code_dtype = name, table, first, code_dtype
        self._tables = {}

    def table_on(self, place):
        key = str(place)
        if key not in self._tables:
            self._tables[key] = paddle.to_tensor(self.table, place=place)
        return self._tables[key]


INT8_MAPS = {"int8": _Map("int8", None, -127, "int8"),
             "int8_log": _Map("int8_log", *_log_table(True), "int8"),
             "uint8_log": _Map("uint8_log", *_log_table(False), "uint8")}
assert tuple(INT8_MAPS) == INT8_MAP_NAMES


def record_dtype(name, width):
    """The numpy dtype of one stored row in a checkpoint: its scale and its `width` codes."""
    return np.dtype([("scale", "<f4"), ("codes", INT8_MAPS[name].code_dtype, (int(width),))])


def dequantize(codes, scale, name="int8"):
    """float32 values of `codes` ([..., d]) with `scale` ([...]) under map `name`."""
    m = INT8_MAPS[name]
    if _on_cpu(codes, scale):
        return _dequantize_numpy(codes, scale, m)
    if m.table is None:
        return codes.astype("float32").multiply_((scale / 127.0).unsqueeze(-1))
    index = (codes.astype("int64") - m.first).reshape([-1])
    values = paddle.gather(m.table_on(codes.place), index).reshape(codes.shape)
    return values.multiply_(scale.unsqueeze(-1))


def quantize(x, name="int8", noise=None):
    """float32 `x` ([..., d]) as (codes, scale) under map `name`: scale = max|x| of each row,
    codes rounded to nearest, or stochastically with `noise` (x's shape, uniform in [0, 1))."""
    if x.dtype != paddle.float32:
        raise TypeError(f"quantize expects float32 values, got {x.dtype}")
    m = INT8_MAPS[name]
    if _on_cpu(x) and (noise is None or _on_cpu(noise)):
        return _quantize_numpy(x, m, noise)
    absmax = paddle.max(paddle.abs(x), axis=-1) if x.shape[-1] else \
        paddle.zeros(x.shape[:-1], "float32")
    finite = paddle.isfinite(absmax)
    safe = paddle.where(paddle.logical_and(finite, absmax > 0), absmax, paddle.ones_like(absmax))
    y = x / safe.unsqueeze(-1)  # in [-1, 1]; rows of zeros stay zeros
    y = paddle.where(finite.unsqueeze(-1), y, paddle.zeros_like(y))
    scale = paddle.where(finite, absmax, paddle.full_like(absmax, float("nan")))
    if m.table is None:
        y = y.scale_(127.0)
        y = y.round_() if noise is None else y.add_(noise).floor_()
        return y.clip_(-127.0, 127.0).astype(m.code_dtype), scale
    table = m.table_on(x.place)
    hi = paddle.searchsorted(table, y, right=True).clip_(1, table.shape[0] - 1)  # table[hi-1] <= y
    lo = hi - 1
    low, high = paddle.gather(table, lo.reshape([-1])).reshape(y.shape), \
        paddle.gather(table, hi.reshape([-1])).reshape(y.shape)
    if noise is None:
        up = (y - low) > (high - y)
    else:
        up = noise < (y - low) / (high - low)
    index = lo + up.astype(lo.dtype)
    if m.first == 0:  # non-negative map: a positive value is never stored as 0
        index = paddle.where(paddle.logical_and(index == 0, y > 0), paddle.ones_like(index), index)
    return (index + m.first).astype(m.code_dtype), scale


def _on_cpu(*tensors):
    return cpu_set(*tensors) and all(t.size > 0 and t.is_contiguous() for t in tensors) \
        and applies(tensors[0], dtypes=(paddle.float32, paddle.int8, paddle.uint8))


def _flat(t):
    """A numpy view of `t` as rows ([n, d]; a scale as [n])."""
    return as_numpy(t).reshape(-1, t.shape[-1]) if t.ndim > 1 else as_numpy(t).reshape(-1)


def _dequantize_numpy(codes, scale, m):
    out = paddle.empty(codes.shape, "float32")
    c, s, o = _flat(codes), as_numpy(scale).reshape(-1), _flat(out)
    table = m.table

    def rows(lo, hi):
        if table is None:
            np.multiply(c[lo:hi], (s[lo:hi] / np.float32(127))[:, None], out=o[lo:hi])
        else:
            np.take(table, c[lo:hi].astype(np.int64) - m.first, out=o[lo:hi])
            o[lo:hi] *= s[lo:hi, None]
    run_rows(rows, c.shape[0], max(1, _SLAB_VALUES // max(1, c.shape[1])))
    return out


def _count_at_most(m, y):
    """`np.searchsorted(m.table, y, side="right")` (the number of the logarithmic map's values
    <= y, for y in [-1, 1]) without a binary search: the octave and eighth from log2|y|, then
    one exact comparison each way with the table mends an estimate that log2's rounding put one
    off."""
    t, n = m.table, len(m.table)
    a = np.abs(y)
    with np.errstate(divide="ignore"):
        eighths = np.floor(np.log2(a) * np.float32(_LOG_STEPS))  # -inf at 0
    eighths = np.maximum(eighths, -n)
    if m.first == 0:  # values 0, then 2^(-k/8) at index 255 - k
        est = np.where(a > 0, n - 1 + eighths, 0)
    else:  # -2^(-k/8) at index k, 0 at 126, 2^(-k/8) at index 252 - k
        zero = -m.first
        est = np.where(y >= 0, np.maximum(n - 1 + eighths, zero), np.minimum(-eighths, zero - 1))
    j = np.clip(est, 0, n - 1).astype(np.int64)  # the estimated last value <= y
    j -= t[j] > y
    j = np.maximum(j, -1)
    up = np.minimum(j + 1, n - 1)
    j += (t[up] <= y) & (j + 1 < n)
    return j + 1


def _quantize_numpy(x, m, noise):
    """`quantize` on CPU tensors: the same operations in numpy, a slab of rows at a time."""
    codes = paddle.empty(x.shape, m.code_dtype)
    scale = paddle.empty(x.shape[:-1], "float32")
    a, u = _flat(x), (None if noise is None else _flat(noise))
    c, s = _flat(codes), as_numpy(scale).reshape(-1)

    def rows(lo, hi):
        block = a[lo:hi]
        absmax = np.max(np.abs(block), axis=1) if block.shape[1] else \
            np.zeros(hi - lo, np.float32)
        finite = np.isfinite(absmax)
        safe = np.where(finite & (absmax > 0), absmax, np.float32(1))
        y = block / safe[:, None]
        y[~finite] = 0
        s[lo:hi] = np.where(finite, absmax, np.float32(np.nan))
        if m.table is None:
            y *= np.float32(127)
            if u is None:
                np.rint(y, out=y)
            else:
                y += u[lo:hi]
                np.floor(y, out=y)
            np.clip(y, -127, 127, out=y)
            c[lo:hi] = y
            return
        t = m.table
        hi_ = np.clip(_count_at_most(m, y), 1, len(t) - 1)
        low, high = t[hi_ - 1], t[hi_]
        if u is None:
            up = (y - low) > (high - y)
        else:
            up = u[lo:hi] < (y - low) / (high - low)
        index = hi_ - 1 + up
        if m.first == 0:  # non-negative map: a positive value is never stored as 0
            index[(index == 0) & (y > 0)] = 1
        c[lo:hi] = index + m.first
    run_rows(rows, a.shape[0], max(1, _SLAB_VALUES // max(1, a.shape[1])))
    return codes, scale


class Int8Rows:
    """Values stored as 8-bit codes and a float32 scale per row (see the module docstring).
    `codes`: `[n, ..., d]` int8 (uint8 for "uint8_log"), `scale`: `[n, ...]` float32."""

    def __init__(self, codes, scale, name="int8"):
        if name not in INT8_MAPS:
            raise ValueError(f"8-bit map must be one of {', '.join(INT8_MAPS)}, got {name!r}")
        if list(scale.shape) != list(codes.shape[:-1]):
            raise ValueError(f"scale shape {list(scale.shape)} does not match codes "
                             f"{list(codes.shape)} (one scale a row)")
        self.codes, self.scale, self.map = codes, scale, INT8_MAPS[name]
        self.stop_gradient = False  # its gradient reaches an optimizer through the head's sink

    @classmethod
    def zeros(cls, shape, name="int8"):
        return cls(paddle.zeros(shape, dtype=INT8_MAPS[name].code_dtype),
                   paddle.zeros(shape[:-1], dtype="float32"), name)

    @classmethod
    def from_float(cls, x, name="int8", noise=None):
        return cls(*quantize(x, name, noise), name)

    @property
    def shape(self):
        return list(self.codes.shape)

    @property
    def ndim(self):
        return self.codes.ndim

    @property
    def place(self):
        return self.codes.place

    @property
    def nbytes(self):
        return int(self.codes.size) + 4 * int(self.scale.size)

    def reshape(self, shape):
        """A view with rows regrouped (the last axis, the row, unchanged)."""
        codes = self.codes.reshape(shape)
        if codes.shape[-1] != self.codes.shape[-1]:
            raise ValueError(f"an 8-bit array keeps its row width {self.codes.shape[-1]}, "
                             f"got shape {shape}")
        return Int8Rows(codes, self.scale.reshape(codes.shape[:-1]), self.map.name)

    def rows(self, start=0, stop=None):
        """Rows [start, stop) as float32."""
        return dequantize(self.codes[start:stop], self.scale[start:stop], self.map.name)

    def subset(self, index):
        """Rows `index` (int64 `[k]`) as a new array of this storage (codes and scales)."""
        return type(self)(_take(self.codes, index), paddle.gather(self.scale, index),
                          self.map.name)

    def take(self, index):
        """Rows `index` (int64 `[k]`) as float32."""
        return dequantize(_take(self.codes, index), paddle.gather(self.scale, index),
                          self.map.name)

    def set_value(self, values):
        """Store `values` (any float tensor or array of this shape) in every row, rounded to
        nearest."""
        values = values if isinstance(values, paddle.Tensor) else paddle.to_tensor(values)
        self.write(0, values.astype("float32").reshape(self.shape))

    def write(self, where, values, noise=None, keep=None):
        """Store float32 `values` in rows `where` (a slice start, or an int64 index `[k]`),
        each row with its new scale; rounded to nearest, or stochastically with `noise`.
        `keep`: a 0-d bool tensor; where true the rows keep their codes and scales."""
        codes, scale = self._encode(values, noise)
        if keep is not None:
            old_codes, old_scale = self._stored(where, codes.shape[0])
            codes = paddle.where(keep, old_codes.astype("int32"), codes.astype("int32")) \
                .astype(self.map.code_dtype)  # no 8-bit `where` on Paddle 3.3's CPU
            scale = paddle.where(keep, old_scale, scale)
        if isinstance(where, int):
            self.codes[where:where + codes.shape[0]] = codes
            self.scale[where:where + codes.shape[0]] = scale
        else:
            _put(self.codes, where, codes)
            self._put_scale(where, scale)

    def _encode(self, values, noise):
        """(codes, scales) of float32 `values` (rounded with `noise`, or to nearest)."""
        return quantize(values, self.map.name, noise)

    def _put_scale(self, where, scale):
        """scale[where] = `scale`, rows at an int64 index."""
        if self.scale.ndim == 1:
            self.scale.scatter_(where, scale, overwrite=True)
        else:
            self.scale.index_put_((where,), scale)

    def _stored(self, where, count):
        """The codes and scales rows `where` hold now."""
        if isinstance(where, int):
            return self.codes[where:where + count], self.scale[where:where + count]
        return _take(self.codes, where), paddle.gather(self.scale, where)


def _take(codes, index):
    """Rows `index` of 8-bit `codes` (rows of an even width as int16 words through
    `take_rows`: Paddle 3.3 has no 8-bit index_select on the CPU)."""
    if codes.ndim == 2 and codes.shape[1] % 2 == 0:
        return take_rows(codes.view("int16"), index).view(codes.dtype)
    return paddle.gather(codes, index)


def _put(codes, index, values):
    """codes[index] = values, rows of 8-bit codes (Paddle 3.3 has no 8- or 16-bit scatter on
    the CPU: rows whose width is a multiple of 4 move as int32 words, others by index_put_)."""
    if codes.ndim == 2 and codes.shape[1] % 4 == 0:
        codes.view("int32").scatter_(index, values.view("int32"), overwrite=True)
    else:
        codes.index_put_((index,), values)
