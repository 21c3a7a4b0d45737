"""Numerics the head relies on: its storage dtypes and their conversions, an exact sqrt.

Class centres and their optimizer state may be stored in 16 bits; all arithmetic is float32.
`to_float32` is the upcast every GEMM and update reads through; `cast_nearest` rounds float32
to a storage dtype to nearest even (stochastic rounding is `plsc.optim.round_to`).

`sqrt_exact`: Paddle 3.3's float32 `sqrt` on CPU is not correctly rounded in its vectorised
path, so its result for an element depends on the element's position in the tensor (measured:
the same values give different bits when the tensor is sliced differently). The float64 sqrt
is correctly rounded, and rounding it to float32 gives the correctly rounded float32 root.
"""
import paddle

from ..dtypes import FLOAT_DTYPES as STORAGE_DTYPES  # the float storage dtypes

__all__ = ["STORAGE_DTYPES", "SLAB_BYTES", "DEVICE_SLAB_BYTES", "dtype_name", "to_float32", "cast_nearest",
           "sqrt_exact"]

SLAB_BYTES = 32 << 20  # bytes a slab-wise pass handles at a time: 16-bit rows upcast to float32
# (where not per block), head rows streamed to or from a checkpoint, centres read by cleaning
# The device kernel set's budget (Paddle ops: a GPU, or PLSC_KERNELS=device): float32 bytes of
# rows one pass takes at a time. Every slab costs the same fixed number of launches, so a slab is
# as large as a card spares for a few temporaries of its size: 131,072 rows of width 512, so
# a Partial FC step's sampled rows (up to 10% of 1,000,000 classes) are one slab.
DEVICE_SLAB_BYTES = 256 << 20


def dtype_name(dtype):
    """'float32', 'bfloat16' or 'float16' for a Paddle dtype or name; ValueError otherwise."""
    name = str(dtype).replace("paddle.", "")
    if name not in STORAGE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(STORAGE_DTYPES)}, got {dtype}")
    return name


def to_float32(t):
    """`t` as float32: itself when it is float32, else an upcast copy (exact)."""
    return t if t.dtype == paddle.float32 else t.astype("float32")


def cast_nearest(x, dtype):
    """float32 `x` stored as `dtype`, rounded to nearest even (float32: x itself)."""
    name = dtype_name(dtype)
    if name == "float32":
        return x
    if name == "float16":
        # Paddle 3.3's CPU cast returns garbage for |x| in (2^-89, 2^-77). Adding and
        # subtracting 2^-52 sends |x| < 2^-76 to 0 and keeps |x| >= 2^-26; in between
        # it stays below 2^-25, which rounds to 0 either way.
        x = (x + 2.0 ** -52) - 2.0 ** -52
    return x.astype(name)


def sqrt_exact(x):
    """Correctly rounded float32 square root of float32 `x`, whatever its shape or slicing."""
    return paddle.sqrt(x.astype("float64")).astype("float32")
