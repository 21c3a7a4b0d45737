"""The 4-bit maps' tables and their numpy kernels (the CPU kernel set of `plsc.storage.int4`).

The linear map is written by its formula (`quantize_linear_rows`). A logarithmic map's positive
values are the half-octave boundaries 2^(-k/2), float32: 2^-j, and float32(√2) times 2^-j,
whose bits are an exponent and the mantissa of √2 (`_SQRT2_MANTISSA`). So the bracket of |y|
(the largest table magnitude l <= |y| and the next, h) is read off y's bits with integer
operations: no search and no table lookup per value (numpy's fancy indexing costs about ten
elementwise passes). The device set looks the same brackets up in `rows` by
`paddle.searchsorted`; both then round with the same IEEE operations: nearest (y − low) > (high
− y), stochastic noise < (y − low) / (high − low), low and high the signed bracket. A negative
y equal to a table value takes the bracket below it here ((−h, −l], up with fraction 1) and the
one above it on the device ([−l, ...), fraction 0): the same code.
"""
import threading

import numpy as np

__all__ = ["BLOCK", "LEVELS", "blocks", "table", "linear_table", "rows", "pair_values",
           "quantize_rows", "quantize_linear_rows", "dequantize_rows"]

BLOCK = 128  # values sharing one scale
LEVELS = 7  # the linear map's codes -LEVELS … LEVELS, value code / LEVELS
_SQRT2_MANTISSA = int(np.float32(np.sqrt(2.0)).view(np.int32)) & 0x7FFFFF
_EXPONENT = 0x7F800000


def blocks(width):
    """Scales of a row of `width` values."""
    return -(-int(width) // BLOCK)


def table(signed):
    """(ascending float32 values, index of 0) of a 4-bit logarithmic map."""
    if signed:
        mags = 2.0 ** (-np.arange(7, dtype=np.float64) / 2)
        return np.concatenate([-mags, [0.0], mags[::-1]]).astype(np.float32), 7
    return np.concatenate([[0.0], (2.0 ** (-np.arange(15, dtype=np.float64) / 2))[::-1]]) \
        .astype(np.float32), 0


def linear_table():
    """(ascending float32 values, index of 0) of the linear 4-bit map: k / LEVELS."""
    return (np.arange(-LEVELS, LEVELS + 1, dtype=np.float64) / LEVELS).astype(np.float32), LEVELS


def _nibble(index, first):
    return (index - first) % 16


def rows(values, first):
    """float32 `[n + 1, 5]`: for each count j of table values <= y (`searchsorted(right)`),
    (low, high, high − low, low's nibble, high's nibble) of y's bracket. Rows 0 and n - 1 are
    the clipped brackets; a non-negative map's row 0 and 1 are (0, 0, 0, 0, 1): (y − 0) > (0 − y)
    and noise < y / 0 hold for every y > 0 and for no other, so a positive value is never
    stored as 0. Row n (y = 1, and NaN: Paddle's search counts n for it) is (0, 1, 1, 0's
    nibble, 1's nibble): 1 rounds up to 1, NaN (a block of zeros, 0 / 0) to 0."""
    n = len(values)
    out = np.zeros((n + 1, 5), np.float32)
    for j in range(n):
        b = min(max(j, 1), n - 1)
        out[j] = (values[b - 1], values[b], values[b] - values[b - 1],
                  _nibble(b - 1, first), _nibble(b, first))
    if values[0] == 0:
        out[:2] = (0, 0, 0, _nibble(0, first), _nibble(1, first))
    out[n] = (0, 1, 1, _nibble(first, first), _nibble(n - 1, first))
    return out


def pair_values(values, first):
    """float32 `[256, 2]`: the two values of each byte (low nibble first)."""
    by_nibble = np.zeros(16, np.float32)  # the signed map's unused nibble 8 reads as 0
    by_nibble[_nibble(np.arange(len(values)), first)] = values
    byte = np.arange(256)
    return np.stack([by_nibble[byte & 15], by_nibble[byte >> 4]], 1)


def dequantize_rows(codes, scale, out, pairs64):
    """out (`[n, d]` float32) = the values of bytes `codes` (`[n, d/2]`) times their block's
    scale (`[n, blocks]`); `pairs64`: `pair_values` viewed as 8-byte words."""
    np.take(pairs64, codes, out=out.view(np.uint64), mode="wrap")
    d, nb = out.shape[1], scale.shape[1]
    if d == nb * BLOCK:
        out.reshape(out.shape[0], nb, BLOCK)[...] *= scale[:, :, None]
        return
    for j in range(nb):
        out[:, j * BLOCK:(j + 1) * BLOCK] *= scale[:, j:j + 1]


_local = threading.local()  # each kernel thread's buffers (fresh arrays cost page faults)


_KINDS = {"y": np.float32, "up": np.bool_, "c": np.uint8, "w": "<u2",
          **{k: np.int32 for k in ("a", "low", "high", "g", "q", "m")}}


class _Buffers(dict):
    """Flat buffers of `n` values by name ("w": n/2 + 1), each made on its first use: a
    linear-map write takes three of them, a logarithmic one all ten."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def __missing__(self, key):
        out = self[key] = np.empty(self.n // 2 + 1 if key == "w" else self.n, _KINDS[key])
        return out


def _buffers(n):
    """Named flat buffers of at least `n` values, this thread's, reused across calls."""
    have = getattr(_local, "buffers", None)
    if have is None or have.n < n:
        have = _local.buffers = _Buffers(n)
    return have


def _scales(x, y):
    """(block scales with NaN for non-finite blocks, divisors: 1 for zero or non-finite
    blocks) of rows `x` (`[n, d]`); `y`: scratch of x's shape."""
    n, d = x.shape
    nb = blocks(d)
    if d == nb * BLOCK:
        absmax = np.abs(x, out=y).reshape(n, nb, BLOCK).max(-1)
    else:
        absmax = np.stack([np.abs(x[:, j * BLOCK:(j + 1) * BLOCK]).max(1) for j in range(nb)], 1)
    finite = np.isfinite(absmax)
    return np.where(finite, absmax, np.float32(np.nan)), \
        np.where(finite & (absmax > 0), absmax, np.float32(1))


def _divide(x, safe, scale, y):
    """y = x / its block's divisor, 0 in non-finite blocks."""
    n, d = x.shape
    nb = safe.shape[1]
    if d == nb * BLOCK:
        np.divide(x.reshape(n, nb, BLOCK), safe[:, :, None], out=y.reshape(n, nb, BLOCK))
    for j in range(nb if d != nb * BLOCK else 0):
        np.divide(x[:, j * BLOCK:(j + 1) * BLOCK], safe[:, j:j + 1],
                  out=y[:, j * BLOCK:(j + 1) * BLOCK])
    bad = np.isnan(scale)
    if bad.any():
        for i, j in zip(*np.nonzero(bad)):
            y[i, j * BLOCK:(j + 1) * BLOCK] = 0


def _brackets(b, buf, signed, smallest):
    """(l, h, q), int32 buffers, from y's bits `b`: the float32 bits of the largest positive
    table value l <= |y| (0 below the map's smallest) and of the next, h (the non-negative map:
    0 below its smallest, as in `rows`), and q, l's count among the positive values.
    buf["a"] keeps |y|'s bits."""
    a, low, high, g, q = (buf[k][:b.size].reshape(b.shape) for k in ("a", "low", "high", "g", "q"))
    np.bitwise_and(b, 0x7FFFFFFF, out=a)
    np.bitwise_and(a, _EXPONENT, out=low)
    low += _SQRT2_MANTISSA  # s: √2 times |y|'s power of two
    np.subtract(a, low, out=g)
    g >>= 31  # -1 where |y| < s
    np.right_shift(low, 22, out=q)  # 2·exponent; + 1 + g: |y|'s half-octave
    q += g
    q += 1 - (254 - smallest[1])  # less the smallest's half-octave, + 1
    up = (1 << 23) - _SQRT2_MANTISSA
    np.bitwise_and(g, -up, out=high)
    high += low
    high += up  # h: s where |y| < s, else twice the power of two
    g &= -_SQRT2_MANTISSA
    low += g  # l: the power of two where |y| < s, else s
    np.subtract(a, smallest[0], out=g)
    g >>= 31  # -1 below the smallest positive value: (0, smallest), or (0, 0)
    small = buf["m"][:b.size].reshape(b.shape)
    np.invert(g, out=small)
    low &= small
    high &= small
    q &= small
    if signed:
        g &= smallest[0]
        high |= g
    return low, high, q


def _signed_parts(b, buf, low, high, signed, nearest):
    """(y − low, high − y) of y's signed bracket (low, high): (l, h), or (−h, −l) where y < 0,
    as float32 views; `high` becomes h − l (high − low either way). For y < 0 y − low is
    h − |y| and high − y is |y| − l, the same IEEE results. The nibble count q becomes −h's
    for y < 0 (16 − (q + 1) = q ^ 15), done by the caller with buf["m"]."""
    a, g = (buf[k][:b.size].reshape(b.shape).view(np.float32) for k in ("a", "g"))
    lf, hf = low.view(np.float32), high.view(np.float32)
    np.subtract(hf, a, out=g)  # h − |y|
    np.subtract(hf, lf, out=hf)
    np.subtract(a, lf, out=lf)  # |y| − l
    if not signed:
        return lf, g
    m = buf["m"][:b.size].reshape(b.shape)
    np.right_shift(b, 31, out=m)  # -1 where y < 0
    x = g.view(np.int32)
    x ^= low  # (h − |y|) ^ (|y| − l)
    np.bitwise_and(x, m, out=a.view(np.int32))
    low ^= a.view(np.int32)  # y − low
    if nearest:
        x ^= low  # the other part: high − y
    return lf, g


def _pack(c, codes, buf):
    """codes (`[n, d/2]` uint8) = the nibbles `c` (flat uint8, high bits ignored) two a byte:
    element 2j the low nibble of byte j, 2j + 1 the high one."""
    w = c.view("<u2")
    w &= 0x0F0F
    np.right_shift(w, 4, out=buf["w"][:w.size])
    w |= buf["w"][:w.size]
    np.copyto(codes.reshape(-1), w, casting="unsafe")  # the low byte: 2j low, 2j + 1 high


def quantize_linear_rows(x, noise, codes, scale):
    """Codes and scales of float32 rows `x` under the linear map: k = floor(LEVELS·y + noise)
    (nearest: rint), at most LEVELS (LEVELS + noise can round up to LEVELS + 1), kept as its
    two's complement nibble; y = x / its block's scale, 0 in non-finite blocks."""
    buf = _buffers(x.size)
    y = buf["y"][:x.size].reshape(x.shape)
    scale[...], safe = _scales(x, y)
    _divide(x, safe, scale, y)
    y *= np.float32(LEVELS)
    if noise is None:
        np.rint(y, out=y)
    else:
        y += noise
        np.floor(y, out=y)
        np.minimum(y, np.float32(LEVELS), out=y)
    c = buf["c"][:x.size]
    np.copyto(c.view(np.int8), y.reshape(-1), casting="unsafe")
    _pack(c, codes, buf)


def quantize_rows(x, noise, codes, scale, signed, smallest):
    """Codes (`[n, d/2]` uint8) and scales (`[n, blocks]`) of float32 rows `x` (`[n, d]`):
    `plsc.storage.int4.quantize`'s arithmetic on one slab. `smallest`: (bits of the map's
    smallest positive value, its count of positive values)."""
    buf = _buffers(x.size)
    y = buf["y"][:x.size].reshape(x.shape)
    scale[...], safe = _scales(x, y)
    _divide(x, safe, scale, y)
    if not signed:
        np.maximum(y, 0, out=y)  # a negative value is stored as 0, as the device set does
    low, high, q = _brackets(y.view(np.int32), buf, signed, smallest)
    num, other = _signed_parts(y.view(np.int32), buf, low, high, signed, noise is None)
    up = buf["up"][:x.size].reshape(x.shape)
    if noise is None:
        np.greater(num, other, out=up)
    else:
        with np.errstate(divide="ignore", invalid="ignore"):  # the (0, 0) bracket: ±inf, NaN
            num /= high.view(np.float32)  # high holds h − l
        np.less(noise, num, out=up)
    if signed:  # y < 0: −h's nibble, 16 − (q + 1) = q ^ 15
        m = buf["m"][:x.size].reshape(x.shape)
        m &= 15
        q ^= m
    c = buf["c"][:x.size]
    np.copyto(c, q.reshape(-1), casting="unsafe")
    c += up.reshape(-1).view(np.uint8)  # a signed code of 16 is 0: the pack keeps 4 bits
    _pack(c, codes, buf)
