"""Step buffers that outlive the step, so the next step writes into them.

A fresh host allocation is not free: the kernel faults its pages in, zeroed, on
first touch. Measured on the project's 2-core VM, that cost 0.5 to 2.7 s of
system time per GB, more than the pass over the data itself; a head step at
12.5M classes per rank allocates several GB. Paddle's ops write into an
existing tensor through `out=` (`matmul`, `index_select`), so the head keeps
its largest buffers here and lends them to each step. On a GPU, Paddle's
caching allocator already keeps freed blocks; lending changes nothing there.

A buffer is lent to one owner at a time, until `give_back` or until the owner
is garbage collected (a weak reference: e.g. the autograd context of a forward
whose backward never ran). A request while it is lent returns None, and the
caller allocates as usual, so two forwards before one backward stay correct.
"""
import weakref

import paddle

__all__ = ["Workspace"]


class Workspace:
    """Named buffers reused from step to step (one shape per name is kept)."""

    def __init__(self, enabled=True):
        self.enabled = bool(enabled)
        self._buffers = {}  # name -> (tensor, (shape, dtype))
        self._owners = {}  # name -> weak reference to the borrower

    def lend(self, name, shape, owner, dtype="float32"):
        """A `shape` buffer of `dtype` for `owner` (contents undefined), or None when
        disabled or already lent to a live owner."""
        if not self.enabled:
            return None
        ref = self._owners.get(name)
        if ref is not None and ref() is not None:
            return None
        spec = (tuple(int(s) for s in shape), str(dtype))
        buf, kept = self._buffers.get(name, (None, None))
        if kept != spec:
            self._buffers.pop(name, None)  # free the old one before allocating the new
            buf = paddle.empty(list(spec[0]), dtype=dtype)
            self._buffers[name] = (buf, spec)
        self._owners[name] = weakref.ref(owner)
        return buf

    def give_back(self, name):
        self._owners.pop(name, None)

    def clear(self):
        """Free every buffer (they are allocated again when next needed)."""
        self._buffers, self._owners = {}, {}

    @property
    def nbytes(self):
        return sum(int(b.size) * b.element_size() for b, _ in self._buffers.values())
