"""Step buffers that outlive the step, so the next step writes into them.

A fresh host allocation is not free: the kernel faults its pages in, zeroed, on
first touch. Measured on the project's 2-core VM, that cost 0.5 to 2.7 s of
system time per GB, more than the pass over the data itself; a head step at
12.5M classes per rank allocates several GB. Paddle's ops write into an
existing tensor through `out=` (`matmul`, `index_select`), so the head keeps
its largest buffers here and lends them to each step. On a GPU, Paddle's
caching allocator already keeps freed blocks; lending changes nothing there.

One buffer is kept per name, the largest asked for: a smaller request gets a view of its
first elements (the last, narrower block of a shard borrows the full blocks' buffer), so what
is kept is at most one buffer of each kind, whatever the widths.

A buffer is lent to one owner at a time, until `give_back` or until the owner
is garbage collected (a weak reference: e.g. the autograd context of a forward
whose backward never ran). A request while it is lent returns None, and the
caller allocates as usual, so two forwards before one backward stay correct.
"""
import math
import weakref

import paddle

__all__ = ["Workspace"]


class Workspace:
    """Named buffers reused from step to step (one shape per name is kept)."""

    def __init__(self, enabled=True):
        self.enabled = bool(enabled)
        self._buffers = {}  # name -> (tensor, dtype)
        self._owners = {}  # name -> weak reference to the borrower

    def lend(self, name, shape, owner, dtype="float32"):
        """A `shape` buffer of `dtype` for `owner` (contents undefined; a view of the kept
        buffer's first elements when that is larger), or None when disabled or already lent
        to a live owner."""
        if not self.enabled:
            return None
        ref = self._owners.get(name)
        if ref is not None and ref() is not None:
            return None
        shape = [int(s) for s in shape]
        size = math.prod(shape)
        buf, kept = self._buffers.get(name, (None, None))
        if kept != str(dtype) or buf.size < size:
            self._buffers.pop(name, None)  # free the old one before allocating the new
            buf = paddle.empty(shape, dtype=dtype)
            self._buffers[name] = (buf, str(dtype))
        self._owners[name] = weakref.ref(owner)
        if list(buf.shape) == shape:
            return buf
        return buf.reshape([-1])[:size].reshape(shape)

    def give_back(self, name):
        """End the loan of buffer `name`: the next `lend` may hand it out again."""
        self._owners.pop(name, None)

    def clear(self):
        """Free every buffer (they are allocated again when next needed)."""
        self._buffers, self._owners = {}, {}

    @property
    def nbytes(self):
        """Bytes held by the kept buffers (lent or not)."""
        return sum(int(b.size) * b.element_size() for b, _ in self._buffers.values())
