"""The names of the head's storage dtypes, the one place they are listed (no Paddle import:
the config schema and the tools read them).

- `FLOAT_DTYPES`: float head arrays (Paddle tensors of these dtypes).
- `INT8_MAP_NAMES`: the 8-bit maps of `plsc.storage.int8` (a byte per value, a scale per row).
- `INT4_MAP_NAMES`: the 4-bit maps of `plsc.storage.int4` (two codes a byte, a scale per block).
- `HEAD_DTYPES`: what a head array or its optimizer state may be asked to be stored as ("int8"
  picks the map that suits the array).
- `STATE_DTYPES`: what the head's optimizer state may be asked to be stored as: `HEAD_DTYPES`
  and "int4" (the map that suits each state array).
- `STORED_DTYPES`: what a stored array is (checkpoints' `head_dtypes`).
- `asked_as`: the `STATE_DTYPES` name a stored dtype is asked for by ("uint4_log" -> "int4").
"""

__all__ = ["FLOAT_DTYPES", "INT8_MAP_NAMES", "INT4_MAP_NAMES", "HEAD_DTYPES", "STATE_DTYPES",
           "STORED_DTYPES", "asked_as"]

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
INT8_MAP_NAMES = ("int8", "int8_log", "uint8_log")
INT4_MAP_NAMES = ("int4", "int4_log", "uint4_log")
HEAD_DTYPES = FLOAT_DTYPES + ("int8",)
STATE_DTYPES = HEAD_DTYPES + ("int4",)
STORED_DTYPES = FLOAT_DTYPES + INT8_MAP_NAMES + INT4_MAP_NAMES


def asked_as(stored):
    """The `STATE_DTYPES` name that stores an array as `stored`: an 8-bit map "int8", a 4-bit
    map "int4", a float dtype itself."""
    if stored in INT8_MAP_NAMES:
        return "int8"
    return "int4" if stored in INT4_MAP_NAMES else stored
