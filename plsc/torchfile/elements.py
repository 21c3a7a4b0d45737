"""The element types of torch's storages and dtypes as numpy reads them, and the error of
`plsc.torchfile`."""
import numpy as np


class TorchFileError(ValueError):
    """A file `load` cannot read (damaged, legacy format, a refused global ...) or an object
    `save` cannot write; the message is one line and names the file."""


class TorchDtype(str):
    """A torch dtype object found in a file, as its name ("torch.float32"); `numpy` is the
    numpy dtype of its elements (None where numpy has none), bfloat16 as uint16 bits."""

    def __new__(cls, name, numpy_dtype):
        self = super().__new__(cls, f"torch.{name}")
        self.numpy = None if numpy_dtype is None else np.dtype(numpy_dtype)
        return self


_BF16 = "bfloat16"  # storage kind of bfloat16: uint16 bits in the file, float32 out

# legacy storage class -> element type (the numpy dtype; bfloat16 -> _BF16)
_STORAGE_TYPES = {
    "FloatStorage": "f4", "DoubleStorage": "f8", "HalfStorage": "f2", "BFloat16Storage": _BF16,
    "LongStorage": "i8", "IntStorage": "i4", "ShortStorage": "i2", "CharStorage": "i1",
    "ByteStorage": "u1", "BoolStorage": "?", "ComplexFloatStorage": "c8",
    "ComplexDoubleStorage": "c16",
}
# torch dtype names as torch >= 2 pickles them (`torch.float32` ...) -> element type
_DTYPES = {
    "float32": "f4", "float64": "f8", "float16": "f2", "bfloat16": _BF16, "int64": "i8",
    "int32": "i4", "int16": "i2", "int8": "i1", "uint8": "u1", "uint16": "u2", "uint32": "u4",
    "uint64": "u8", "bool": "?", "complex64": "c8", "complex128": "c16",
    # dtypes numpy has no type for: allowed as values, refused as tensor dtypes
    "complex32": None, "float8_e4m3fn": None, "float8_e5m2": None, "float8_e4m3fnuz": None,
    "float8_e5m2fnuz": None, "float8_e8m0fnu": None, "float4_e2m1fn_x2": None, "qint8": None,
    "quint8": None, "qint32": None, "quint4x2": None, "quint2x4": None,
}


def _numpy_kind(kind):
    """The numpy dtype a storage element kind is read as (bfloat16: its uint16 bits)."""
    return np.dtype("u2") if kind == _BF16 else np.dtype(kind)


# numpy dtype -> torch storage class (`_rebuild_tensor_v2`)
_SAVE_TYPES = {
    np.dtype("f4"): "FloatStorage", np.dtype("f8"): "DoubleStorage",
    np.dtype("f2"): "HalfStorage", np.dtype("i8"): "LongStorage", np.dtype("i4"): "IntStorage",
    np.dtype("i2"): "ShortStorage", np.dtype("i1"): "CharStorage", np.dtype("u1"): "ByteStorage",
    np.dtype("?"): "BoolStorage", np.dtype("c8"): "ComplexFloatStorage",
    np.dtype("c16"): "ComplexDoubleStorage",
}
# numpy dtype -> torch dtype name (`_rebuild_tensor_v3` on an untyped storage)
_SAVE_V3 = {np.dtype("u2"): "uint16", np.dtype("u4"): "uint32", np.dtype("u8"): "uint64"}
