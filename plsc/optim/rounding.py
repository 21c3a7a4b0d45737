"""Rounding float32 rows into 16-bit storage: to nearest even, or stochastically; and the
uniform noise that 8-bit storage rounds with (`plsc.storage.int8`).

`round_to(x, "bfloat16")` stores each value as its lower or upper 16-bit neighbour
`lo <= x <= hi`, the upper with probability `(x - lo) / (hi - lo)`, so the stored
value equals x in expectation and small updates survive on average. The random
bits are a pure function of (seed, stream, step, rank, row, column): how the
caller splits the rows into chunks does not change them, and a resumed run draws
what the uninterrupted one would have drawn.

Method.
- bfloat16 is the top half of the float32 pattern: add 16 random bits to the
  pattern read as int32, keep the top 16 bits. The sign is a separate bit, so
  this rounds the magnitude up with the right probability for negative values
  too; inf and the sign of zero stay, values above the largest bfloat16 go to inf
  with the probability of their distance to 2^128, NaN is stored as a quiet NaN.
- float16 is `floor(x / ulp + u) * ulp` with `ulp` the float16 spacing at x
  (2^(e - 10) for x in [2^e, 2^(e+1)), at least 2^-24 for subnormals, capped at
  32 so that overflow gives inf) and `u` 13 random bits in [0, 1). Exact for
  |x| >= 2^-14 (the normal float16 range); below, x's bits beyond 2^-13 of an ulp
  are rounded first, so `|E[stored] - x| < 2^-37`. Zeros are stored as +0.
- The bits of element (i, j) are `a_i XOR b_j`, `a` hashed from the row's global
  index and `b` from the column (splitmix64 in int64 tensor ops, keyed by seed,
  stream, step and rank): uniform and pairwise independent (not 4-wise: the bits
  of a 2x2 block XOR to 0), so rounding errors are uncorrelated, at the cost of
  one broadcast per block.
- The device set (`plsc.kernels.cpu_kernels.cpu_set`) computes the same bits in fewer, larger ops
  (one broadcast XOR; constants and the column terms made once per device, a batch's hash
  keys copied there 1,024 steps at a time); the CPU set keeps
  the expand and in-place XOR that Paddle's CPU kernels run faster.
- 8-bit storage rounds with `uniform_noise`: 23 of the same bits as the mantissa of a
  float in [1, 2), minus 1: uniform on the multiples of 2^-23 in [0, 1).

Everything is tensor ops on x's device; nothing is read back to the host.
"""
import sys

import paddle

from ..kernels.cpu_kernels import cpu_set
from ..kernels.numerics import cast_nearest, dtype_name

__all__ = ["round_to", "round_stacked", "uniform_noise", "StochasticBits", "BitsBatch"]

if sys.byteorder != "little":  # the bfloat16 path takes the upper halves of int32 words
    raise ImportError("plsc.optim.rounding assumes a little-endian host")

_M64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_COLUMN = 1 << 62  # column j is hashed as 2^62 + j, apart from every row index
_QUIET_NAN = 0x7FC00000
_CONSTANTS = {}


def _mix64(z):
    """splitmix64's finaliser on a Python int (exact 64-bit arithmetic)."""
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def _key(seed, stream, step, rank):
    k = 0
    for v in (seed, stream, step, rank):
        k = _mix64((k + _GOLDEN) ^ (int(v) & _M64))
    return k


def _signed(v):
    return v - (1 << 64) if v >> 63 else v


def _const(value, place, dtype="int64"):
    """A 0-d tensor `value` of `dtype` on `place`, made once (no copy to the device per call).
    A Python int in an int64 op would pass through a float and lose bits above 2^53; a tensor
    operand multiplies and adds modulo 2^64."""
    key = (value, str(place), dtype)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = paddle.to_tensor(_signed(value) if dtype == "int64" else value,
                                               dtype=dtype, place=place)
    return t


def _constants(place):
    """The hash's 0-d int64 constants on `place`."""
    c = lambda v: _const(v, place)  # noqa: E731
    return {"golden": c(_GOLDEN), "mix1": c(_MIX1), "mix2": c(_MIX2), 30: c(30), 27: c(27),
            31: c(31), "column": c(_COLUMN)}


def _key_tensor(key, place):
    """The 0-d int64 hash key on `place`: a fill on the device, no copy from the host."""
    return paddle.full([], _signed(key), dtype="int64").to(place)


_KEY_STEPS = 1024  # steps of hash keys made at once (`_keys_tensor`)
_KEY_TABLES = {}  # (seed, streams, rank, place) -> (first step, [_KEY_STEPS, K, 1] keys)


def _keys_tensor(seed, streams, step, rank, place):
    """`[len(streams), 1]` int64: the hash keys of `streams` at `step`, sliced (one op) from a
    table of `_KEY_STEPS` steps' keys copied to `place` once per that many steps."""
    first = step - step % _KEY_STEPS
    key = (seed, tuple(streams), rank, str(place))
    held = _KEY_TABLES.get(key)
    if held is None or held[0] != first:
        values = [[[_signed(_key(seed, s, t, rank))] for s in streams]
                  for t in range(first, first + _KEY_STEPS)]
        held = _KEY_TABLES[key] = (first, paddle.to_tensor(values, dtype="int64", place=place))
    return held[1][step - first]


def _column_terms(m, place):
    """`(2^62 + j)·golden` (modulo 2^64) for the columns j < m, made once per width."""
    key = ("columns", m, str(place))
    if key not in _CONSTANTS:
        c = _constants(place)
        _CONSTANTS[key] = (paddle.arange(m, dtype="int64").to(place) + c["column"]) * c["golden"]
    return _CONSTANTS[key]


def _hash(v, key, c):
    """splitmix64(v·golden + key), elementwise on an int64 tensor (wrapping int64 ops,
    logical right shifts)."""
    z = v * c["golden"] + _key_tensor(key, v.place)
    return _mix(z, c)


def _mix(z, c):
    """splitmix64's finaliser on an int64 tensor."""
    shr = lambda z, s: paddle.bitwise_right_shift(z, c[s], is_arithmetic=False)  # noqa: E731
    z = paddle.bitwise_xor(z, shr(z, 30)) * c["mix1"]
    z = paddle.bitwise_xor(z, shr(z, 27)) * c["mix2"]
    return paddle.bitwise_xor(z, shr(z, 31))


def _random_bits(rows, m, key, bits, place, shift=0, base=0):
    """`[r, m]` int32: `bits` uniform random bits at bit `shift` (row bits XOR column bits),
    OR `base`."""
    c = _constants(place)
    r = rows.shape[0]
    cols = paddle.arange(m, dtype="int64").to(place) + c["column"]
    h = _hash(paddle.concat([rows.astype("int64"), cols]), key, c)
    # Tensor operands throughout: a Python int would pass through a float.
    h = paddle.bitwise_right_shift(h, _const(64 - bits, place), is_arithmetic=False)
    h = paddle.bitwise_left_shift(h, _const(shift, place))
    a = paddle.bitwise_or(h[:r], _const(base, place))
    a = a.astype("int32").reshape([r, 1])
    # expand copies (it is no view), so the XOR below may work in place; it broadcasts a [m]
    # operand, which Paddle's CPU kernels run several times faster than a [1, m] one.
    return paddle.expand(a, [r, m]).bitwise_xor_(h[r:].astype("int32"))


def _random_bits_device(rows, m, key, bits, place, shift=0, base=0):
    """`_random_bits` in fewer, larger ops (the device set; the same bits): the column terms
    made once per width, the row and column bits combined by one broadcast XOR."""
    c = _constants(place)
    r = rows.shape[0]
    rows = rows if rows.dtype == paddle.int64 else rows.astype("int64")
    z = paddle.concat([rows * c["golden"], _column_terms(m, place)]) + _key_tensor(key, place)
    h = paddle.bitwise_right_shift(_mix(z, c), _const(64 - bits, place), is_arithmetic=False)
    if shift:
        h = paddle.bitwise_left_shift(h, _const(shift, place))
    h = h.astype("int32")  # at most 23 bits: exact
    column = h[r:] if not base else paddle.bitwise_or(h[r:], _const(base, place, "int32"))
    return paddle.bitwise_xor(h[:r].reshape([r, 1]), column)  # base: not among the random bits


def _bfloat16_stochastic_device(x, noise, pairs=False):
    """`_bfloat16_stochastic` in fewer ops (the device set; the same bits); `pairs`: as int32
    pairs of them (`round_stacked`)."""
    bits = noise.add_(x.view("int32"))
    bits = paddle.where(paddle.isnan(x), _const(_QUIET_NAN, x.place, "int32"), bits)
    high = paddle.bitwise_right_shift(bits, _const(16, x.place, "int32"), is_arithmetic=True)
    return high.astype("int16").view("int32" if pairs else "bfloat16")


def _bfloat16_stochastic(x, noise):
    bits = noise.add_(x.view("int32"))
    high = bits.view("int16").reshape(x.shape + [2])[..., 1].contiguous()  # little-endian
    # Only a NaN can carry out of its exponent (int32 wrap-around): store a quiet NaN.
    return high.masked_fill_(paddle.isnan(x), _QUIET_NAN >> 16).view("bfloat16")


def _float16_stochastic(x, noise):
    ulp = _float16_ulp(x)
    u = noise.view("float32").scale_(1.0, bias=-1.0)  # [1, 2) -> [0, 1) in steps of 2^-13
    # x + u·ulp = ulp·(x/ulp + u) rounded alike (ulp is a power of two), so this is
    # floor(x/ulp + u)·ulp, computed in one buffer.
    t = u.multiply_(ulp).add_(x).divide_(ulp)
    return t.floor_().multiply_(ulp).astype("float16")


def _float16_ulp(x):
    """float16's spacing at each value of x: 2^(e - 10) for |x| in [2^e, 2^(e+1)), at least
    2^-24 (subnormals), at most 32 (the spacing at 65504; larger values overflow to inf)."""
    exponent = paddle.expand(_const(0x7F800000, x.place, "int32").reshape([1, 1]), x.shape)
    power = exponent.bitwise_and_(x.view("int32")).view("float32")  # 2^e; 0 below normal
    return power.clip_(2.0 ** -14, 2.0 ** 15).scale_(2.0 ** -10)


def round_stacked(values, dtype, bits, pairs=False):
    """float32 `values` (`[K, r, m]`: K arrays' rows, or one array's `[r, m]`) rounded
    stochastically to the 16-bit `dtype` in one pass, with `bits` of the same shape
    (`BitsBatch`'s; consumed): the device set's rounding, each array with the bits
    `round_to` gives it. `pairs` (m even): the 16-bit values' bits as int32 pairs."""
    if dtype_name(dtype) == "bfloat16":
        return _bfloat16_stochastic_device(values, bits, pairs)
    out = _float16_stochastic(values, bits)
    return out.view("int32") if pairs else out


def round_to(x, dtype, mode="stochastic", seed=0, step=0, rank=0, rows=None, stream=0):
    """float32 `x: [r, ...]` stored as `dtype` (float32: x itself).

    Args:
        mode: "stochastic" (unbiased: the upper neighbour with probability
            (x - lo) / (hi - lo)) or "nearest" (to nearest even, like `astype`).
        seed: with `step`, `rank` and `stream`, what the random bits depend on
            besides the position.
        step: see `seed`.
        rank: see `seed`.
        stream: see `seed`; give each array its own stream.
        rows: int64 `[r]` global indices of x's rows (None: 0..r-1). Bits depend
            on them, not on where a row sits in x.
    """
    name = dtype_name(dtype)
    if x.dtype != paddle.float32:
        raise TypeError(f"round_to expects float32 values, got {x.dtype}")
    if mode not in ("stochastic", "nearest"):
        raise ValueError(f"mode must be 'stochastic' or 'nearest', got {mode!r}")
    if name == "float32":
        return x
    if x.size == 0:
        return x.astype(name)
    if mode == "nearest":
        return cast_nearest(x, name)
    r = x.shape[0]
    m = x.size // r
    rows = paddle.arange(r, dtype="int64").to(x.place) if rows is None else rows
    key = _key(seed, stream, step, rank)
    flat = x if x.ndim == 2 else x.reshape([r, m])
    cpu = cpu_set(x)
    random_bits = _random_bits if cpu else _random_bits_device
    if name == "bfloat16":
        out = (_bfloat16_stochastic if cpu else _bfloat16_stochastic_device)(
            flat, random_bits(rows, m, key, 16, x.place))
    else:  # 13 bits at the top of a float32 mantissa, exponent 0: a float in [1, 2)
        out = _float16_stochastic(flat, random_bits(rows, m, key, 13, x.place, 10, 0x3F800000))
    return out if x.ndim == 2 else out.reshape(x.shape)


def uniform_noise(rows, m, seed=0, step=0, rank=0, stream=0, place=None):
    """`[len(rows), m]` float32 noise, uniform on the multiples of 2^-23 in [0, 1), a pure
    function of (seed, stream, step, rank, the global row index in `rows`, column), like
    `round_to`'s bits: what 8-bit stochastic writes round with."""
    place = rows.place if place is None else place
    key = _key(seed, stream, step, rank)
    random_bits = _random_bits if cpu_set(rows) else _random_bits_device
    bits = random_bits(rows, m, key, 23, place, 0, 0x3F800000)
    return bits.view("float32").scale_(1.0, bias=-1.0)


_SPECS = {"bfloat16": (16, 0, 0), "float16": (13, 10, 0x3F800000)}  # (bits, shift, base)
_NOISE = (23, 0, 0x3F800000)  # 8-bit storage's uniform noise


class StochasticBits:
    """The random bits of one array's stochastic writes in one step, as `plsc.storage.put`
    asks for them: `round` (16 bits) and `noise` (8 bits) for the given global rows. With a
    `BitsBatch` that holds this array's stream (the device set), its bits come from the
    batch; they are the same bits."""

    def __init__(self, seed, stream, step, rank, batch=None):
        self.seed, self.stream, self.step, self.rank = seed, stream, step, rank
        self.batch = batch

    def _batched(self, rows, m):
        b = self.batch
        if b is None or self.stream not in b.streams or rows is not b.rows or m != b.m:
            return None
        return b.bits(self.stream)

    def round(self, values, dtype, rows):
        bits = self._batched(rows, values.size // max(1, values.shape[0]))
        if bits is None or values.ndim != 2:
            return round_to(values, dtype, "stochastic", seed=self.seed, step=self.step,
                            rank=self.rank, rows=rows, stream=self.stream)
        return round_stacked(values, dtype, bits)  # one array: the same pass

    def noise(self, rows, m):
        bits = self._batched(rows, m)
        if bits is None:
            return uniform_noise(rows, m, seed=self.seed, step=self.step, rank=self.rank,
                                 stream=self.stream)
        return bits.view("float32").scale_(1.0, bias=-1.0)


class BitsBatch:
    """The device set's random bits for several arrays written at the same rows in one step
    (an optimizer update: the weight and its state), hashed together in one pass the first
    time one is asked for: `streams` maps each array's stream to its storage name
    ("bfloat16", "float16", or an 8-bit map: noise). The bits are `round_to`'s and
    `uniform_noise`'s for the same (seed, stream, step, rank, row, column)."""

    def __init__(self, seed, step, rank, rows, m, streams):
        self.seed, self.step, self.rank, self.rows, self.m = seed, step, rank, rows, m
        self.streams = dict(streams)
        self._groups = None  # [(streams, int32 bits [len(streams), r, m])]

    def bits(self, stream):
        """`[r, m]` int32: the bits of one stream."""
        for streams, bits in self._computed():
            if stream in streams:
                return bits[streams.index(stream)]
        raise KeyError(stream)

    def stacked(self, streams):
        """`[len(streams), r, m]` int32: the bits of `streams` in that order, when they are
        the streams of one extraction (arrays of one storage), else None."""
        for group, bits in self._computed():
            if list(streams) == group:
                return bits
        return None

    def _computed(self):
        if self._groups is None:
            self._groups = self._compute()
        return self._groups

    def _compute(self):
        rows, m = self.rows, self.m
        place, r = rows.place, rows.shape[0]
        c = _constants(place)
        streams = list(self.streams)
        keys = _keys_tensor(self.seed, streams, self.step, self.rank, place)  # [K, 1]
        rows = rows if rows.dtype == paddle.int64 else rows.astype("int64")
        z = paddle.concat([rows * c["golden"], _column_terms(m, place)]) + keys  # [K, r + m]
        h = _mix(z, c)
        specs = [_SPECS.get(self.streams[s], _NOISE) for s in streams]
        if len(set(specs)) == 1:  # one extraction for all: [K, r, m]
            groups = [(list(range(len(streams))), specs[0])]
        else:
            groups = [([k], spec) for k, spec in enumerate(specs)]
        out = []
        for ks, (bits, shift, base) in groups:
            part = h if len(ks) == len(streams) else h[ks[0]:ks[0] + 1]
            part = paddle.bitwise_right_shift(part, _const(64 - bits, place), is_arithmetic=False)
            if shift:
                part = paddle.bitwise_left_shift(part, _const(shift, place))
            part = part.astype("int32")
            row, column = paddle.split(part, [r, m], axis=1)
            if base:
                column = paddle.bitwise_or(column, _const(base, place, "int32"))
            both = paddle.bitwise_xor(row.unsqueeze(2), column.unsqueeze(1))
            out.append(([streams[k] for k in ks], both))
        return out
