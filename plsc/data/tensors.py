"""Numpy arrays into Paddle tensors without `paddle.to_tensor`, which in Paddle 3.3.1 leaves one
small Python list alive per call (a per-step call is a slow leak over a long run)."""
import numpy as np
import paddle

__all__ = ["to_tensor"]


def to_tensor(array, into=None, place=None):
    """A Paddle tensor holding a copy of the numpy `array`, on `place` (default: the current
    device): `into` (a tensor of the same shape and dtype, overwritten) or a new one. Not
    `paddle.to_tensor`: in Paddle 3.3.1 each call of it leaves a small Python list alive."""
    tensor = into
    if tensor is None or tuple(tensor.shape) != array.shape or tensor.dtype != _DTYPES[array.dtype]:
        tensor = paddle.empty(list(array.shape), dtype=str(array.dtype))
    tensor.get_tensor().set(np.ascontiguousarray(array),
                            place or paddle.framework._current_expected_place())
    return tensor


class _Dtypes(dict):
    def __missing__(self, dtype):
        self[dtype] = paddle.empty([0], dtype=str(dtype)).dtype
        return self[dtype]


_DTYPES = _Dtypes()  # numpy dtype -> Paddle dtype
