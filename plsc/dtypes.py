"""The names of the head's storage dtypes, the one place they are listed (no Paddle import:
the config schema and the tools read them).

- `FLOAT_DTYPES`: float head arrays (Paddle tensors of these dtypes).
- `INT8_MAP_NAMES`: the 8-bit maps of `plsc.quantized` (a byte per value, a scale per row).
- `HEAD_DTYPES`: what a head array or its optimizer state may be asked to be stored as ("int8"
  picks the map that suits the array).
- `STORED_DTYPES`: what a stored array is (checkpoints' `head_dtypes`).
"""

__all__ = ["FLOAT_DTYPES", "INT8_MAP_NAMES", "HEAD_DTYPES", "STORED_DTYPES"]

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
INT8_MAP_NAMES = ("int8", "int8_log", "uint8_log")
HEAD_DTYPES = FLOAT_DTYPES + ("int8",)
STORED_DTYPES = FLOAT_DTYPES + INT8_MAP_NAMES
