"""Counting what would stop a GPU's queue: reads of a tensor's values on the host and ops whose
output shape depends on the data.

`HostReads()` patches the entry points (`Tensor.numpy`, `.item`, `.tolist`, `__array__`,
`int()` / `float()` / `bool()` / `index()` of a tensor; `paddle.unique`, `masked_select`,
`nonzero` and their Tensor methods) for the duration of a `with` block and records each call
with the plsc lines it came from. A call made inside another counted call (Paddle's `float()`
goes through `numpy()`) counts once.
"""
import os
import traceback

import paddle

READS = ("numpy", "item", "tolist", "__array__", "__int__", "__float__", "__bool__", "__index__",
         "__nonzero__")
SHAPE_OPS = ("unique", "masked_select", "nonzero")
PLSC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plsc")


def _caller():
    """'file:line function' of the innermost plsc frame on the stack (then ' < ' and the next
    plsc frame out, the one that called it), or of the last frame outside plsc."""
    frames = traceback.extract_stack()[:-2]  # without this function and the wrapper
    found = [f"plsc{f.filename[len(PLSC):]}:{f.lineno} {f.name}" for f in reversed(frames)
             if f.filename.startswith(PLSC)][:2]
    if found:
        return " < ".join(found)
    return f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].name}"


class HostReads:
    """`with HostReads(host=(t, ...)) as counted:` then `counted.reads`, `counted.shape_ops`:
    lists of (entry point, caller). `host`: tensors that live on the host even on a GPU (a read
    of them waits for nothing), not counted. `skip(caller)`: a predicate leaving out callers."""

    def __init__(self, host=(), skip=None):
        self.host_ids = {id(t) for t in host}
        self.skip = skip or (lambda caller: False)
        self.reads, self.shape_ops = [], []
        self._saved = []
        self._depth = 0
        self.active = True

    def _wrap(self, fn, name, into, is_read):
        counter = self

        def wrapper(*args, **kwargs):
            outer = counter._depth == 0 and counter.active
            counter._depth += 1
            try:
                if outer and not (is_read and args and id(args[0]) in counter.host_ids):
                    caller = _caller()
                    if not counter.skip(caller):
                        into.append((name, caller))
                return fn(*args, **kwargs)
            finally:
                counter._depth -= 1
        return wrapper

    def _patch(self, owner, name, into, is_read):
        original = getattr(owner, name, None)
        if original is None:
            return
        self._saved.append((owner, name, original))
        setattr(owner, name, self._wrap(original, name, into, is_read))

    def __enter__(self):
        for name in READS:
            self._patch(paddle.Tensor, name, self.reads, True)
        for name in SHAPE_OPS:
            self._patch(paddle, name, self.shape_ops, False)
            self._patch(paddle.Tensor, name, self.shape_ops, False)
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []
        return False
