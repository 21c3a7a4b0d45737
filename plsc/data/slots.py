"""A ring of shared-memory slots through which loader workers hand batches to the main process.

Each slot is an anonymous shared-memory file (`os.memfd_create`) made before the workers fork,
so every worker and the main process hold its descriptor. A slot belongs to one batch at a
time (the main process names it in the task and takes it back once it has copied the batch
out), so no two processes ever write it at once. The worker collates its samples straight into
the slot -- growing the file when a batch is larger than any before in that slot -- and sends
only the slot number and each field's (dtype, shape, offset) through its pipe: no pickling of
the images, one copy from the decoded samples into the slot and one from the slot into the
batch's tensor.
"""
import mmap
import numbers
import os
import tempfile

import numpy as np

__all__ = ["Slots", "field_specs"]

_ALIGN = 64  # bytes: each field starts on a cache line


def field_specs(samples):
    """[(kind, dtype, shape)] of the batch `collate` would make of `samples`, or None when
    some field is not one `collate` stacks (collate then raises its own error)."""
    specs = []
    for values in zip(*samples):
        first = values[0]
        if isinstance(first, np.ndarray):
            if any(not isinstance(v, np.ndarray) or v.shape != first.shape or v.dtype != first.dtype
                   for v in values):
                return None
            specs.append(("array", first.dtype, (len(values),) + first.shape))
        elif isinstance(first, numbers.Integral):
            specs.append(("int", np.dtype(np.int64), (len(values),)))
        elif isinstance(first, numbers.Real):
            specs.append(("float", np.dtype(np.float32), (len(values),)))
        else:
            return None
    return specs


def _layout(specs):
    """(offsets, total bytes) of the fields `specs` laid out one after the other, aligned."""
    offsets, end = [], 0
    for _, dtype, shape in specs:
        offsets.append(end)
        end += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, end


class Slots:
    """`count` shared-memory slots; make it before forking the processes that share it."""

    def __init__(self, count):
        self.fds = [_anonymous_file(f"plsc-slot{i}") for i in range(count)]
        self.maps = {}  # slot -> this process's mapping of it (remapped when the slot grows)

    def _map(self, slot, nbytes, grow):
        current = self.maps.get(slot)
        if current is not None and len(current) >= nbytes:
            return current
        fd = self.fds[slot]
        size = os.fstat(fd).st_size
        if size < nbytes:
            if not grow:
                raise ValueError(f"slot {slot} holds {size} bytes, less than the {nbytes} announced")
            size = nbytes
            os.ftruncate(fd, size)
        if current is not None:
            _close(current)
        self.maps[slot] = mmap.mmap(fd, size)
        return self.maps[slot]

    def write(self, slot, samples, pause=None):
        """Collate `samples` into `slot` (as `collate` would stack them); returns the fields'
        [(dtype string, shape, offset)], or None when `collate` has to be used instead.
        `pause()` (the test hook) is called when half of the first field is written."""
        specs = field_specs(samples)
        if specs is None:
            return None
        offsets, total = _layout(specs)
        buf = self._map(slot, max(total, 1), grow=True)
        meta = []
        for f, ((kind, dtype, shape), offset) in enumerate(zip(specs, offsets)):
            out = np.frombuffer(buf, dtype, int(np.prod(shape, dtype=np.int64)), offset).reshape(shape)
            if kind == "array":
                for i, sample in enumerate(samples):
                    if pause is not None and f == 0 and i == len(samples) // 2:
                        pause()
                    out[i] = sample[f]
            else:
                out[...] = np.asarray([s[f] for s in samples], dtype=dtype)
            del out
            meta.append((dtype.str, shape, offset))
        return meta

    def read(self, slot, meta):
        """The fields `write` put in `slot`, as numpy views of the slot (valid until the slot is
        written again; copy them out before handing the slot back)."""
        need = max((off + int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
                    for dt, shape, off in meta), default=1)
        buf = self._map(slot, need, grow=False)
        return [np.frombuffer(buf, np.dtype(dt), int(np.prod(shape, dtype=np.int64)), off).reshape(shape)
                for dt, shape, off in meta]

    def close(self):
        for m in self.maps.values():
            _close(m)
        self.maps.clear()
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _close(mapping):
    try:
        mapping.close()
    except BufferError:  # a view of it is still alive: the mapping goes with the last view
        pass


def _anonymous_file(name):
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    fd, path = tempfile.mkstemp(prefix=name)  # other systems: an unlinked temporary file
    os.unlink(path)
    return fd
