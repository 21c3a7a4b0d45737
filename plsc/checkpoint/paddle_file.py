"""A Paddle state written in `paddle.save`'s format, streamed into a file: each tensor becomes
numpy bytes when the pickler reaches it and is dropped once written, so a save holds one
tensor's host copies at a time, never the whole serialised state (`paddle.save` into a
`BytesIO` held the numpy copies, their pickled bytes and the buffer's: about three times the
state). `paddle.load` reads the file as one `paddle.save` wrote: a flat dict of tensors is
pickled as numpy arrays beside the `StructuredToParameterName@@` name table, any other object
with each tensor as `(name, array)` (Paddle's two layouts); pickle protocol 4 writes each
array's bytes straight to the file."""
import pickle

import numpy as np
import paddle

NAME_TABLE = "StructuredToParameterName@@"  # paddle.save's key: structured name -> tensor name
_PER_TENSOR = 512  # bytes of pickle around a tensor's data at most (key, name, shape, dtype)
HOST_COPIES = 2  # a tensor's numpy copy and its pickled bytes, alive while the tensor is written


def _is_tensor(value):
    return isinstance(value, paddle.Tensor)


def _flat(state):
    """Whether `paddle.save` writes `state` as a state dict of arrays (a dict of tensors)."""
    return isinstance(state, dict) and bool(state) and all(_is_tensor(v) for v in state.values())


def _host(tensor):
    return np.array(tensor.cpu())  # what paddle.save stores: bfloat16 as uint16


class _Pickler(pickle.Pickler):
    """No memo (`fast`): nothing pickled is kept, so each host copy dies after its write."""

    def __init__(self, f, as_tuple):
        super().__init__(f, protocol=4)
        self.fast = True  # state dicts hold no cycles; the memo would keep every array alive
        self.as_tuple = as_tuple

    def reducer_override(self, obj):
        if not _is_tensor(obj):
            return NotImplemented
        if self.as_tuple:
            return tuple, ((obj.name, _host(obj)),)
        return _host(obj).__reduce_ex__(4)


def write_paddle_file(f, state):
    """Pickle `state` into the binary file object `f` as `paddle.save(state, ...)` would."""
    if _flat(state):
        state = dict(state, **{NAME_TABLE: {k: v.name for k, v in state.items()}})
        _Pickler(f, as_tuple=False).dump(state)
    else:
        _Pickler(f, as_tuple=True).dump(state)


def save_transient_bytes(largest_tensor_bytes):
    """What `write_paddle_file` holds beyond the state at its peak: the host copies of its
    largest tensor (the planner's term for a save)."""
    return HOST_COPIES * int(largest_tensor_bytes)


def _tensors(obj):
    if _is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def paddle_file_bytes(state):
    """An upper bound of the bytes `write_paddle_file(f, state)` writes (for the free-space
    check before a save): the tensors' data, a bound of the pickle around each, and the
    rest of the object pickled without them."""
    tensors = list(_tensors(state))
    data = sum(int(t.numel()) * t.element_size() for t in tensors)
    rest = len(pickle.dumps(_without_tensors(state), protocol=4))
    return data + _PER_TENSOR * len(tensors) + rest


def _without_tensors(obj):
    if _is_tensor(obj):
        return None
    if isinstance(obj, dict):
        return {k: _without_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_without_tensors(v) for v in obj)
    return obj
