"""The MXNet image-record payload: a 24-byte IRHeader, optional labels, the image.

IRHeader is ``flag:uint32, label:float32, id:uint64, id2:uint64`` (little
endian). When ``flag > 0`` the header's label field is unused and ``flag``
float32 labels follow it; the encoded image takes the rest of the payload.
"""
import collections
import numbers
import struct

import numpy as np

from .errors import DataError

__all__ = ["IRHeader", "pack", "unpack", "HEADER_SIZE"]

IRHeader = collections.namedtuple("IRHeader", ["flag", "label", "id", "id2"])
_STRUCT = struct.Struct("<IfQQ")
HEADER_SIZE = _STRUCT.size


def pack(label, image=b"", id=0, id2=0):
    """Payload bytes for `image` (encoded bytes) with a scalar or array `label`."""
    if isinstance(label, numbers.Number):
        return _STRUCT.pack(0, label, id, id2) + bytes(image)
    labels = np.asarray(label, dtype="<f4").ravel()
    return _STRUCT.pack(labels.size, 0.0, id, id2) + labels.tobytes() + bytes(image)


def unpack(payload):
    """``(IRHeader, image)``; ``header.label`` is a float, or a float32 array when flag > 0."""
    if len(payload) < HEADER_SIZE:
        raise DataError(f"payload has {len(payload)} bytes, expected at least the {HEADER_SIZE}-byte IRHeader")
    flag, label, id_, id2 = _STRUCT.unpack_from(payload)
    start = HEADER_SIZE
    if flag > 0:
        start += 4 * flag
        if len(payload) < start:
            raise DataError(f"payload has {len(payload)} bytes, expected at least {start} "
                            f"for the IRHeader and its {flag} labels")
        label = np.frombuffer(payload, dtype="<f4", count=flag, offset=HEADER_SIZE)
    return IRHeader(flag, label, id_, id2), payload[start:]
