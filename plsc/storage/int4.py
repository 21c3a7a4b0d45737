"""4-bit head arrays: two codes a byte and one float32 scale per block of `BLOCK` values.

An `Int4Rows` stores `[n, ..., d]` values (d even) as `[n, ..., d/2]` bytes and
`[n, ..., ceil(d/BLOCK)]` scales: value = map(code) · scale, the scale being the largest
magnitude of its block (the last block of a row holds the rest), recomputed whenever the row is
written. Rows are independent: writing some rows leaves every other row bit for bit.

`BLOCK` = 128: one scale per 512-wide row is too coarse at 4 bits. Measured on real momentum
and moment rows (`benchmarks/benchmark_int4_state.py`, docs/head.md): the relative RMS error of
AdamW's first moment is 0.145 with one scale a row against 0.124 with 128-value blocks (0.114
with 64, at twice the scales' 16 B/class).

Maps (the storage dtype names, as checkpoints' `head_dtypes` spell them), chosen by the same
measurement and by their write's cost:
- "int4": signed, linear: k / 7 for k = -7 … 7 (15 codes), written as floor(7·y + noise) or
  rounded, as the linear "int8" map is. SGD momentum: 5 % more error than "int4_log" (0.117
  against 0.111), written in a few numpy passes where the logarithmic maps take some 30.
- "int4_log": signed, logarithmic: 0 and ±2^(-k/2) for k = 0 … 6 (15 codes; relative steps of
  41 % down to 1/8 of the block's largest value). AdamW's first moment (linear: 18 % more error).
- "uint4_log": non-negative, logarithmic: 0 and 2^(-k/2) for k = 0 … 14 (16 codes, down to
  2^-7). AdamW's second moment; a positive value is never stored as 0 (values below the
  smallest step are stored as it), so no update is divided by 0 + ε.

A code is a value's index in its map's ascending table minus the index of 0, kept modulo 16
(two's complement for the signed map), so a zero byte is two zeros. Element 2j of a row is the
low nibble of byte j, element 2j + 1 the high one.

Writing (`quantize`) rounds to nearest or, with `noise` (uniform in [0, 1), one per value),
stochastically as `plsc.storage.int8` does (the logarithmic maps up where noise < the fraction of
the bracket, the linear one where fraction + noise >= 1); a block with a NaN or an infinity
gets a NaN scale (its codes are 0). The CPU kernel set runs numpy on the tensors' memory, a
slab of rows per kernel thread, finding a logarithmic map's bracket from each value's bits
(`plsc.storage.int4_tables`); the device set runs batched Paddle ops: the bracket's row of a
small table by `searchsorted`, the zero-point rule and the clipping folded into that table
(the linear map: its formula), two nibbles a byte by one product with (1, 16), reads through
a 256-entry table of byte pairs. The same IEEE operations, so the
same bits (tested). Device ops at d = 512 (logarithmic maps): 18 a write (19 with noise), 6 a read
(docs/memory_and_benchmarks.md, "4-bit state").
"""
import numpy as np
import paddle
import paddle.nn.functional as F

from ..kernels.cpu_kernels import applies, as_numpy, cpu_set, run_rows
from ..dtypes import INT4_MAP_NAMES
from .int8 import Int8Rows, _Map, _take
from .int4_tables import BLOCK, LEVELS, blocks, dequantize_rows, linear_table, \
    pair_values, quantize_linear_rows, quantize_rows, rows as _rows, table as _table

__all__ = ["BLOCK", "INT4_MAPS", "Int4Rows", "quantize", "dequantize", "record_dtype"]

_SLAB_VALUES = 1 << 17  # values of a slab of rows on the CPU path (fewer numpy calls a value)

INT4_MAPS = {"int4": _Map("int4", *linear_table(), "uint8"),
             "int4_log": _Map("int4_log", *_table(True), "uint8"),
             "uint4_log": _Map("uint4_log", *_table(False), "uint8")}
assert tuple(INT4_MAP_NAMES) == tuple(INT4_MAPS)  # `first`: the index of 0 in the table
_LINEAR = "int4"  # the one map written by a formula, not by brackets from a table

_ROWS = {name: _rows(m.table, m.first) for name, m in INT4_MAPS.items() if name != _LINEAR}
_PAIRS = {name: pair_values(m.table, m.first) for name, m in INT4_MAPS.items()}
_PAIRS64 = {name: p.view(np.uint64).reshape(-1) for name, p in _PAIRS.items()}
_SMALLEST = {name: (int(m.table[m.first + 1].view(np.int32)),
                    len(m.table) - 1 - m.first) for name, m in INT4_MAPS.items() if name in _ROWS}
_CONSTS = {}  # tensors made once per device


def _const(key, place, make):
    key = (key, str(place))
    if key not in _CONSTS:
        _CONSTS[key] = make()
    return _CONSTS[key]


def _on_device(name, what, place):
    """The map's `rows` (what="rows") or `pair_values` ("pairs") as a tensor on `place`."""
    src = (_ROWS if what == "rows" else _PAIRS)[name]
    return _const((name, what), place, lambda: paddle.to_tensor(src, place=place))


def record_dtype(name, width):
    """The numpy dtype of one stored row in a checkpoint: its scales and its `width / 2` bytes."""
    return np.dtype([("scale", "<f4", (blocks(width),)), ("codes", "u1", (int(width) // 2,))])


def _on_cpu(*tensors):
    return cpu_set(*tensors) and all(t.size > 0 and t.is_contiguous() for t in tensors) \
        and applies(tensors[0], dtypes=(paddle.float32, paddle.uint8))


def dequantize(codes, scale, name):
    """float32 values `[..., 2m]` of bytes `codes` (`[..., m]`) with `scale` (`[..., blocks]`)
    under map `name`: each byte's two values from a 256-entry table, times their scale."""
    width = 2 * codes.shape[-1]
    if _on_cpu(codes, scale):
        out = paddle.empty(codes.shape[:-1] + [width], "float32")
        c, s, o = (as_numpy(t).reshape(-1, t.shape[-1]) for t in (codes, scale, out))

        def slab(lo, hi):
            dequantize_rows(c[lo:hi], s[lo:hi], o[lo:hi], _PAIRS64[name])
        run_rows(slab, c.shape[0], max(1, _SLAB_VALUES // max(1, width)))
        return out
    lead = codes.shape[:-1]
    values = F.embedding(codes.astype("int64"), _on_device(name, "pairs", codes.place))
    if width % BLOCK == 0:  # [..., m, 2] as blocks
        values = values.reshape(lead + [width // BLOCK, BLOCK])
        return values.multiply_(scale.unsqueeze(-1)).reshape(lead + [width])
    per_value = paddle.repeat_interleave(scale, BLOCK, axis=-1)[..., :width]
    return values.reshape(lead + [width]).multiply_(per_value)


def _blocked(v):
    """Rows `v` (`[..., d]`) as `[..., blocks(d), BLOCK]`, the last block padded with zeros."""
    d, lead = v.shape[-1], list(v.shape[:-1])
    pad = blocks(d) * BLOCK - d
    if pad:
        v = paddle.concat([v, paddle.zeros(lead + [pad], v.dtype)], -1)
    return v.reshape(lead + [blocks(d), BLOCK])


def quantize(x, name, noise=None):
    """float32 `x` (`[..., d]`, d even) as (uint8 bytes `[..., d/2]`, float32 scales
    `[..., blocks(d)]`) under map `name`: a scale is its block's max |x|, codes rounded to
    nearest, or stochastically with `noise` (x's shape, uniform in [0, 1))."""
    if x.dtype != paddle.float32:
        raise TypeError(f"quantize expects float32 values, got {x.dtype}")
    if x.shape[-1] % 2:
        raise ValueError(f"4-bit rows need an even width, got {x.shape[-1]}")
    if _on_cpu(x) and (noise is None or _on_cpu(noise)):
        return _quantize_numpy(x, name, noise)
    if name == _LINEAR:
        return _quantize_linear(x, noise)
    d, lead = x.shape[-1], list(x.shape[:-1])
    xb = _blocked(x)
    absmax = paddle.max(paddle.abs(xb), axis=-1, keepdim=True)
    y = xb / absmax  # in [-1, 1]; NaN in blocks of zeros and non-finite blocks
    nan = _const("nan", x.place, lambda: paddle.full([], float("nan"), "float32").to(x.place))
    scale = paddle.where(paddle.isfinite(absmax), absmax, nan).reshape(lead + [blocks(d)])
    # the bracket's row by the count of table values <= y (NaN counts them all: row n)
    low, high, den, c_low, c_high = paddle.unbind(F.embedding(
        paddle.searchsorted(INT4_MAPS[name].table_on(x.place), y, right=True),
        _on_device(name, "rows", x.place)), axis=-1)
    if noise is None:
        up = (y - low) > (high - y)
    else:
        up = _blocked(noise) < (y - low) / den
    c = paddle.where(up, c_high, c_low)  # nibbles as float32
    return _pack(c, d, lead), scale


def _quantize_linear(x, noise):
    """The linear map on the device set: k = floor(LEVELS·y + noise) (nearest: round), at most
    LEVELS, y = x / its block's scale (0 in blocks of zeros and non-finite blocks)."""
    d, lead = x.shape[-1], list(x.shape[:-1])
    xb = _blocked(x)
    absmax = paddle.max(paddle.abs(xb), axis=-1, keepdim=True)
    finite = paddle.isfinite(absmax)
    one = _const("one", x.place, lambda: paddle.ones([], "float32").to(x.place))
    y = xb / paddle.where(paddle.logical_and(finite, absmax > 0), absmax, one)
    zero = _const("zero", x.place, lambda: paddle.zeros([], "float32").to(x.place))
    y = paddle.where(finite, y, zero).scale_(float(LEVELS))
    nan = _const("nan", x.place, lambda: paddle.full([], float("nan"), "float32").to(x.place))
    scale = paddle.where(finite, absmax, nan).reshape(lead + [blocks(d)])
    if noise is None:
        k = y.round_()
    else:
        k = y.add_(_blocked(noise)).floor_().clip_(max=float(LEVELS))
    sixteen = _const("16", x.place, lambda: paddle.full([], 16.0, "float32").to(x.place))
    return _pack(paddle.remainder(k, sixteen), d, lead), scale  # two's complement nibbles


def _pack(c, d, lead):
    """Bytes `[..., d/2]` of nibbles `c` (float32 `[..., blocks, BLOCK]`): element 2j the low
    nibble of byte j, 2j + 1 the high one, by one product with (1, 16)."""
    c = c.reshape(lead + [-1])[..., :d] if blocks(d) * BLOCK != d else c
    weights = _const("pack", c.place, lambda: paddle.to_tensor([1.0, 16.0], place=c.place))
    return paddle.matmul(c.reshape(lead + [d // 2, 2]), weights).astype("uint8")


def _quantize_numpy(x, name, noise):
    """`quantize` on CPU tensors: `plsc.storage.int4_tables.quantize_rows`, a slab of rows at a
    time."""
    d, nb = x.shape[-1], blocks(x.shape[-1])
    codes = paddle.empty(x.shape[:-1] + [d // 2], "uint8")
    scale = paddle.empty(x.shape[:-1] + [nb], "float32")
    a = as_numpy(x).reshape(-1, d)
    u = None if noise is None else as_numpy(noise).reshape(-1, d)
    c, s = as_numpy(codes).reshape(-1, d // 2), as_numpy(scale).reshape(-1, nb)
    signed = INT4_MAPS[name].first != 0

    def slab(lo, hi):
        if name == _LINEAR:
            quantize_linear_rows(a[lo:hi], None if u is None else u[lo:hi], c[lo:hi], s[lo:hi])
            return
        quantize_rows(a[lo:hi], None if u is None else u[lo:hi], c[lo:hi], s[lo:hi], signed,
                      _SMALLEST[name])
    run_rows(slab, a.shape[0], max(1, _SLAB_VALUES // max(1, d)))
    return codes, scale


class Int4Rows(Int8Rows):
    """Values stored as 4-bit codes, two a byte, and a float32 scale per block of `BLOCK`
    values (see the module docstring); reads and writes rows as `Int8Rows` does.
    `codes`: `[n, ..., d/2]` uint8, `scale`: `[n, ..., blocks(d)]` float32."""

    def __init__(self, codes, scale, name="int4"):
        if name not in INT4_MAPS:
            raise ValueError(f"4-bit map must be one of {', '.join(INT4_MAPS)}, got {name!r}")
        width = 2 * codes.shape[-1]
        if list(scale.shape) != list(codes.shape[:-1]) + [blocks(width)]:
            raise ValueError(f"scale shape {list(scale.shape)} does not match codes "
                             f"{list(codes.shape)} (one scale per {BLOCK} values of a row)")
        self.codes, self.scale, self.map = codes, scale, INT4_MAPS[name]
        self.stop_gradient = False

    @classmethod
    def zeros(cls, shape, name="int4"):
        shape = list(shape)
        if shape[-1] % 2:
            raise ValueError(f"4-bit rows need an even width, got shape {shape}")
        return cls(paddle.zeros(shape[:-1] + [shape[-1] // 2], dtype="uint8"),
                   paddle.zeros(shape[:-1] + [blocks(shape[-1])], dtype="float32"), name)

    @classmethod
    def from_float(cls, x, name="int4", noise=None):
        return cls(*quantize(x, name, noise), name)

    @property
    def shape(self):
        return list(self.codes.shape[:-1]) + [2 * self.codes.shape[-1]]

    @property
    def nbytes(self):
        return int(self.codes.size) + 4 * int(self.scale.size)

    def reshape(self, shape):
        """A view with rows regrouped (the last axis, the row, unchanged)."""
        shape = list(shape)
        if shape[-1] not in (-1, self.shape[-1]):
            raise ValueError(f"a 4-bit array keeps its row width {self.shape[-1]}, "
                             f"got shape {shape}")
        codes = self.codes.reshape(shape[:-1] + [self.codes.shape[-1]])
        return Int4Rows(codes, self.scale.reshape(codes.shape[:-1] + [self.scale.shape[-1]]),
                        self.map.name)

    def rows(self, start=0, stop=None):
        return dequantize(self.codes[start:stop], self.scale[start:stop], self.map.name)

    def take(self, index):
        return dequantize(_take(self.codes, index), paddle.gather(self.scale, index),
                          self.map.name)

    def _encode(self, values, noise):
        return quantize(values, self.map.name, noise)

    def _put_scale(self, where, scale):
        if self.scale.ndim == 2:
            self.scale.scatter_(where, scale, overwrite=True)
        else:
            self.scale.index_put_((where,), scale)

