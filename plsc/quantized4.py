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
measurement:
- "int4_log": signed, logarithmic: 0 and ±2^(-k/2) for k = 0 … 6 (15 codes; relative steps of
  41 % down to 1/8 of the block's largest value). SGD momentum and AdamW's first moment.
- "uint4_log": non-negative, logarithmic: 0 and 2^(-k/2) for k = 0 … 14 (16 codes, down to
  2^-7). AdamW's second moment; a positive value is never stored as 0 (values below the
  smallest step are stored as it), so no update is divided by 0 + ε.

A code is a value's index in its map's ascending table minus the index of 0, kept modulo 16
(two's complement for the signed map), so a zero byte is two zeros. Element 2j of a row is the
low nibble of byte j, element 2j + 1 the high one.

Writing (`quantize`) rounds to nearest or, with `noise` (uniform in [0, 1), one per value),
stochastically as `plsc.quantized` does; a block with a NaN or an infinity gets a NaN scale.
The CPU kernel set runs numpy on the tensors' memory, a slab of rows per kernel thread; the
device set runs batched Paddle ops (bitwise and shift ops on uint8 for the nibbles): the same
IEEE operations, so the same bits (tested).
"""
import numpy as np
import paddle

from .cpu_kernels import applies, as_numpy, cpu_set, run_rows
from .dtypes import INT4_MAP_NAMES
from .quantized import Int8Rows, _Map, _take

__all__ = ["BLOCK", "INT4_MAPS", "Int4Rows", "quantize", "dequantize", "record_dtype",
           "pack", "unpack"]

BLOCK = 128  # values sharing one scale
_SLAB_VALUES = 1 << 16  # values of a slab of rows on the CPU path


def _table(signed):
    """(ascending float32 values, index of 0) of a 4-bit logarithmic map."""
    if signed:
        mags = 2.0 ** (-np.arange(7, dtype=np.float64) / 2)
        return np.concatenate([-mags, [0.0], mags[::-1]]).astype(np.float32), 7
    return np.concatenate([[0.0], (2.0 ** (-np.arange(15, dtype=np.float64) / 2))[::-1]]) \
        .astype(np.float32), 0


INT4_MAPS = {"int4_log": _Map("int4_log", *_table(True), "uint8"),
             "uint4_log": _Map("uint4_log", *_table(False), "uint8")}
assert tuple(INT4_MAPS) == INT4_MAP_NAMES  # `first`: the index of 0 in the table


def _by_nibble(m):
    """The map's values indexed by a stored nibble (16; the signed map's unused nibble 8: 0)."""
    values = np.zeros(16, np.float32)
    values[(np.arange(len(m.table)) - m.first) % 16] = m.table
    return values


_NIBBLE_VALUES = {name: _by_nibble(m) for name, m in INT4_MAPS.items()}
_CONSTS = {}  # tensors made once per device


def _nibble_values(name, place):
    key = (name, str(place))
    if key not in _CONSTS:
        _CONSTS[key] = paddle.to_tensor(_NIBBLE_VALUES[name], place=place)
    return _CONSTS[key]


def blocks(width):
    """Scales of a row of `width` values."""
    return -(-int(width) // BLOCK)


def record_dtype(name, width):
    """The numpy dtype of one stored row in a checkpoint: its scales and its `width / 2` bytes."""
    return np.dtype([("scale", "<f4", (blocks(width),)), ("codes", "u1", (int(width) // 2,))])


def _consts(place):
    """0-d uint8 constants 0 … 15 on `place`, made once."""
    key = ("consts", str(place))
    if key not in _CONSTS:
        _CONSTS[key] = {v: paddle.full([], v, "uint8").to(place) for v in range(16)}
    return _CONSTS[key]


def pack(index, zero):
    """uint8 `[..., d/2]` bytes of table indices `index` (`[..., d]`, integers) whose 0 is at
    `zero`: element 2j in the low nibble of byte j, 2j + 1 in the high one."""
    if isinstance(index, np.ndarray):
        c = (index + (16 - zero)).astype(np.uint8) & np.uint8(15)
        return c[..., 0::2] | (c[..., 1::2] << np.uint8(4))
    k = _consts(index.place)
    c = (index + (16 - zero) if zero else index).astype("uint8")
    c = paddle.bitwise_and(c, k[15])  # (index − zero) modulo 16
    c = c.reshape(c.shape[:-1] + [c.shape[-1] // 2, 2])
    return paddle.bitwise_or(c[..., 0], paddle.bitwise_left_shift(c[..., 1], k[4]))


def unpack(codes, zero):
    """int64 `[..., 2m]` table indices of uint8 bytes `codes` (`[..., m]`), `pack` undone."""
    if isinstance(codes, np.ndarray):
        c = np.stack([codes & np.uint8(15), codes >> np.uint8(4)], axis=-1)
        c = c.reshape(codes.shape[:-1] + (2 * codes.shape[-1],))
        return (c + np.uint8(zero)) & np.uint8(15) if zero else c
    k = _consts(codes.place)
    c = paddle.stack([paddle.bitwise_and(codes, k[15]),
                      paddle.bitwise_right_shift(codes, k[4])], axis=-1)
    c = c.reshape(codes.shape[:-1] + [2 * codes.shape[-1]])
    if zero:
        c = paddle.bitwise_and(c + k[zero], k[15])
    return c.astype("int64")


def _on_cpu(*tensors):
    return cpu_set(*tensors) and all(t.size > 0 and t.is_contiguous() for t in tensors) \
        and applies(tensors[0], dtypes=(paddle.float32, paddle.uint8))


def dequantize(codes, scale, name):
    """float32 values `[..., 2m]` of bytes `codes` (`[..., m]`) with `scale` (`[..., blocks]`)
    under map `name` (the map's values looked up by stored nibble)."""
    by_nibble = _NIBBLE_VALUES[name]
    width = 2 * codes.shape[-1]
    if _on_cpu(codes, scale):
        out = paddle.empty(codes.shape[:-1] + [width], "float32")
        c, s, o = (as_numpy(t).reshape(-1, t.shape[-1]) for t in (codes, scale, out))

        def rows(lo, hi):
            v = _blocked(np.take(by_nibble, unpack(c[lo:hi], 0)))
            o[lo:hi] = _unblocked(v * s[lo:hi, :, None], width)
        run_rows(rows, c.shape[0], max(1, _SLAB_VALUES // max(1, width)))
        return out
    values = paddle.gather(_nibble_values(name, codes.place), unpack(codes, 0).reshape([-1]))
    values = _blocked(values.reshape(codes.shape[:-1] + [width]))
    return _unblocked(values.multiply_(scale.unsqueeze(-1)), width)


def _blocked(v):
    """Rows `v` (`[..., d]`, numpy or Paddle) as `[..., blocks(d), BLOCK]`, the last block
    padded with zeros."""
    d = v.shape[-1]
    lead = list(v.shape[:-1])
    pad = blocks(d) * BLOCK - d
    if isinstance(v, np.ndarray):
        if pad:
            v = np.concatenate([v, np.zeros(tuple(lead) + (pad,), v.dtype)], -1)
        return v.reshape(tuple(lead) + (blocks(d), BLOCK))
    if pad:
        v = paddle.concat([v, paddle.zeros(lead + [pad], v.dtype)], -1)
    return v.reshape(lead + [blocks(d), BLOCK])


def _unblocked(v, d):
    """`_blocked` undone: `[..., nb, BLOCK]` as rows of `d` values."""
    lead = list(v.shape[:-2])
    if isinstance(v, np.ndarray):
        return v.reshape(tuple(lead) + (-1,))[..., :d]
    v = v.reshape(lead + [v.shape[-2] * BLOCK])
    return v if v.shape[-1] == d else v[..., :d]


def quantize(x, name, noise=None):
    """float32 `x` (`[..., d]`, d even) as (uint8 bytes `[..., d/2]`, float32 scales
    `[..., blocks(d)]`) under map `name`: a scale is its block's max |x|, codes rounded to
    nearest, or stochastically with `noise` (x's shape, uniform in [0, 1))."""
    if x.dtype != paddle.float32:
        raise TypeError(f"quantize expects float32 values, got {x.dtype}")
    if x.shape[-1] % 2:
        raise ValueError(f"4-bit rows need an even width, got {x.shape[-1]}")
    m = INT4_MAPS[name]
    if _on_cpu(x) and (noise is None or _on_cpu(noise)):
        return _quantize_numpy(x, m, noise)
    d = x.shape[-1]
    xb = _blocked(x)
    absmax = paddle.max(paddle.abs(xb), axis=-1)
    finite = paddle.isfinite(absmax)
    safe = paddle.where(paddle.logical_and(finite, absmax > 0), absmax, paddle.ones_like(absmax))
    y = xb / safe.unsqueeze(-1)  # in [-1, 1]; blocks of zeros stay zeros
    y = paddle.where(finite.unsqueeze(-1), y, paddle.zeros_like(y))
    scale = paddle.where(finite, absmax, paddle.full_like(absmax, float("nan")))
    table = m.table_on(x.place)
    hi = paddle.searchsorted(table, y, right=True).clip_(1, table.shape[0] - 1)
    lo = hi - 1
    low = paddle.gather(table, lo.reshape([-1])).reshape(y.shape)
    high = paddle.gather(table, hi.reshape([-1])).reshape(y.shape)
    if noise is None:
        up = (y - low) > (high - y)
    else:
        up = _blocked(noise) < (y - low) / (high - low)
    index = lo + up.astype(lo.dtype)
    if m.table[0] == 0:  # non-negative map: a positive value is never stored as 0
        index = paddle.where(paddle.logical_and(index == 0, y > 0), paddle.ones_like(index), index)
    return pack(_unblocked(index, d), m.first), scale


_SQRT2_MANTISSA = int(np.float32(np.sqrt(2.0)).view(np.int32)) & 0x7FFFFF


def _count_at_most(m, y):
    """`np.searchsorted(m.table, y, side="right")` (the number of the map's values <= y, for y
    in [-1, 1]) from y's float32 bits, without a search: the magnitudes 2^(-k/2) are 1 and
    float32(√2) times powers of two, so a magnitude's half-octave 2·exponent + (mantissa >= √2's)
    counts them exactly (4 times faster than numpy's search over 16 values)."""
    nm = len(m.table) - 1 - m.first  # the positive values
    a = np.abs(y)
    bits = a.view(np.int32)
    mantissa = bits & 0x7FFFFF
    half = 2 * (bits >> 23) + (mantissa >= _SQRT2_MANTISSA)  # 254 at 1.0, one less a value
    at_most = np.clip(half - (254 - nm), 0, nm)  # positive values <= |y|
    if not m.first:
        return at_most + 1
    exact = ((mantissa == 0) | (mantissa == _SQRT2_MANTISSA)) & (half > 254 - nm)
    return np.where(y >= 0, nm + 1 + at_most, nm - at_most + exact)


def _quantize_numpy(x, m, noise):
    """`quantize` on CPU tensors: the same operations in numpy, a slab of rows at a time."""
    d, nb = x.shape[-1], blocks(x.shape[-1])
    codes = paddle.empty(x.shape[:-1] + [d // 2], "uint8")
    scale = paddle.empty(x.shape[:-1] + [nb], "float32")
    a = as_numpy(x).reshape(-1, d)
    u = None if noise is None else as_numpy(noise).reshape(-1, d)
    c, s = as_numpy(codes).reshape(-1, d // 2), as_numpy(scale).reshape(-1, nb)
    t = m.table

    def rows(lo, hi):
        xb = _blocked(a[lo:hi])
        absmax = np.max(np.abs(xb), axis=-1)
        finite = np.isfinite(absmax)
        safe = np.where(finite & (absmax > 0), absmax, np.float32(1))
        y = xb / safe[..., None]
        y[~finite] = 0
        s[lo:hi] = np.where(finite, absmax, np.float32(np.nan))
        hi_ = np.clip(_count_at_most(m, y), 1, len(t) - 1)
        low, high = t[hi_ - 1], t[hi_]
        if u is None:
            up = (y - low) > (high - y)
        else:
            up = _blocked(u[lo:hi]) < (y - low) / (high - low)
        index = hi_ - 1 + up
        if t[0] == 0:  # non-negative map: a positive value is never stored as 0
            index[(index == 0) & (y > 0)] = 1
        c[lo:hi] = pack(_unblocked(index, d), m.first)
    run_rows(rows, a.shape[0], max(1, _SLAB_VALUES // max(1, d)))
    return codes, scale


class Int4Rows(Int8Rows):
    """Values stored as 4-bit codes, two a byte, and a float32 scale per block of `BLOCK`
    values (see the module docstring); reads and writes rows as `Int8Rows` does.
    `codes`: `[n, ..., d/2]` uint8, `scale`: `[n, ..., blocks(d)]` float32."""

    def __init__(self, codes, scale, name="int4_log"):
        if name not in INT4_MAPS:
            raise ValueError(f"4-bit map must be one of {', '.join(INT4_MAPS)}, got {name!r}")
        width = 2 * codes.shape[-1]
        if list(scale.shape) != list(codes.shape[:-1]) + [blocks(width)]:
            raise ValueError(f"scale shape {list(scale.shape)} does not match codes "
                             f"{list(codes.shape)} (one scale per {BLOCK} values of a row)")
        self.codes, self.scale, self.map = codes, scale, INT4_MAPS[name]
        self.stop_gradient = False

    @classmethod
    def zeros(cls, shape, name="int4_log"):
        shape = list(shape)
        if shape[-1] % 2:
            raise ValueError(f"4-bit rows need an even width, got shape {shape}")
        return cls(paddle.zeros(shape[:-1] + [shape[-1] // 2], dtype="uint8"),
                   paddle.zeros(shape[:-1] + [blocks(shape[-1])], dtype="float32"), name)

    @classmethod
    def from_float(cls, x, name="int4_log", noise=None):
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

