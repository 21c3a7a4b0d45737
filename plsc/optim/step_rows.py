"""The head's rows as the sparse optimizers see them: which rows a step used, the merge of
gradient parts accumulated for the same rows, and a chunk of rows read as float32 and written
back to its storage, rounded."""
import math
import zlib

import paddle

from .. import storage
from ..kernels.cpu_kernels import cpu_set
from .rounding import BitsBatch, StochasticBits, round_stacked

__all__ = ["Rows", "head_params", "head_rows", "merge_sorted", "merge_unique", "row_index"]


def row_index(head, name):
    """Rows of the head's array `name` that the last step used (None: all of them)."""
    return head.sampled_rows if name == "weight" else head.sampled_index


def head_params(head):
    """(name, parameter) of the head's row arrays."""
    yield "weight", head.weight
    if head.bias is not None:
        yield "bias", head.bias


def head_rows(head):
    """(name, parameter, row index or None for all rows, the last backward's gradient of those
    rows or None)."""
    for name, param in head_params(head):
        yield name, param, row_index(head, name), head.row_gradient(name)


def merge_unique(index, grads):
    """(sorted unique rows of `index`, their summed gradient rows): the CPU set's merge."""
    unique, inverse = paddle.unique(index, return_inverse=True)
    summed = paddle.zeros([unique.shape[0]] + list(grads.shape[1:]), dtype=grads.dtype)
    return unique, summed.index_add_(inverse.reshape([-1]), 0, grads)


def merge_sorted(index, grads):
    """(`index` sorted, with its repeats; each entry's row's summed gradient): the device
    set's merge, of a fixed size. A repeated row gets the same gradient at each of its entries,
    so every write of it stores the same values; each row's parts are summed in their order
    (a stable sort), as `merge_unique` sums them."""
    order = paddle.argsort(index, stable=True)
    ordered = paddle.gather(index, order)
    starts = paddle.concat([paddle.ones([1], "int64"),
                            (ordered[1:] != ordered[:-1]).astype("int64")])
    segment = paddle.cumsum(starts) - 1
    summed = paddle.zeros(grads.shape, grads.dtype).index_add_(segment, 0,
                                                               paddle.gather(grads, order))
    return ordered, paddle.gather(summed, segment)


class Rows:
    """A chunk of rows of the parameter `name` (`index[start:stop]`, or rows start..stop
    without an index): reads them from any head array as float32 and writes float32 values
    back in the array's storage (`plsc.storage`), rounded with bits of (seed, stream of the
    array, step, rank, row); with `keep` (a 0-d bool tensor) true, as they were read."""

    def __init__(self, opt, name, rank, index, start, stop, keep=None, arrays=None):
        self.opt, self.name, self.rank, self.keep = opt, name, rank, keep
        self.index = index[start:stop] if index is not None else None
        self.start, self.stop = start, stop
        self.batch = None
        self._pending = []  # 16-bit writes rounded together by `flush` (the device set)
        self._read = {}  # with `keep`: each array's rows as read, what a kept row writes back
        self._masks = {}  # with `keep`: it expanded to each shape written
        if arrays and opt.rounding == "stochastic" and self.index is not None \
                and not cpu_set(self.index):
            # The device set hashes the random bits of every rounded array of these rows
            # at once (the same bits as one array at a time).
            streams = {_stream(name, key): storage.name(t) for key, t in arrays.items()
                       if not storage.is_float32(t) and len(t.shape) > 1}
            if len(streams) > 1:
                width = math.prod(arrays[""].shape[1:])
                self.batch = BitsBatch(opt.seed, opt.step_count, rank, self.index, width,
                                       streams)

    def read(self, t):
        value = self._take(t)
        if self.keep is not None:
            self._read[id(t)] = value  # what a kept row writes back (the optimizers do not
        return value  # modify what they read in place)

    def _take(self, t):
        return storage.read(t, self.start, self.stop) if self.index is None \
            else storage.take(t, self.index)

    def _old(self, t):
        """The rows of `t` as `read` gave them (read now if they were not)."""
        old = self._read.pop(id(t), None)
        return self._take(t) if old is None else old

    def _mask(self, shape):
        """`keep` expanded to `shape`, once per shape."""
        key = tuple(shape)
        if key not in self._masks:
            self._masks[key] = paddle.expand(self.keep, list(shape))
        return self._masks[key]

    def _kept(self, t, value):
        """`value` (float32), or where `keep` is true the rows of `t` as they were: `put`'s
        `keep` (`storage.kept`) on the rows already read, with the mask expanded once."""
        if self.keep is None or value.dtype != paddle.float32 or not storage.has_autograd(t):
            return value  # (`put` refuses keep with other values; 8 bits keep their codes)
        return storage.kept(t, self.index, value, self._mask(value.shape), self._old(t))

    def write(self, t, value, key=""):
        """Store `value` (float32) in these rows of `t`, the array `key` of the parameter
        ("": the parameter itself)."""
        bits = None
        if not storage.is_float32(t):
            self.opt._rounded = True
            if self.opt.rounding == "stochastic":
                if self.batch is not None and storage.name(t) in ("bfloat16", "float16") \
                        and value.ndim == 2:
                    self._pending.append((t, value, key))  # kept in `flush`
                    return
                bits = StochasticBits(self.opt.seed, _stream(self.name, key),
                                      self.opt.step_count, self.rank, self.batch)
        kept = self._kept(t, value)
        storage.put(t, self.start if self.index is None else self.index, kept, bits,
                    self.keep if kept is value else None)

    def flush(self):
        """Store the deferred 16-bit writes (device set, stochastic rounding): arrays whose
        bits `BitsBatch` drew in one extraction are rounded together in one pass (their bits
        are the ones each would get alone; with `keep`, one `where` for them all), then
        stored one by one."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        by_stream = {_stream(self.name, key): (t, value) for t, value, key in pending}
        order = [s for s in self.batch.streams if s in by_stream] + \
            [s for s in by_stream if s not in self.batch.streams]
        bits = self.batch.stacked(order) if len(order) > 1 else None
        if bits is None or len({storage.name(by_stream[s][0]) for s in order}) > 1:
            for stream in order:
                t, value = by_stream[stream]
                storage.put(t, self.index, self._kept(t, value),
                            StochasticBits(self.opt.seed, stream, self.opt.step_count,
                                           self.rank, self.batch))
            return
        values = paddle.stack([by_stream[s][1] for s in order])
        if self.keep is not None:
            old = paddle.stack([self._old(by_stream[s][0]) for s in order])
            values = storage.kept(None, self.index, values, self._mask(values.shape), old)
        pairs = values.shape[-1] % 2 == 0  # the arrays' rows as int32 pairs, split in one op
        rounded = round_stacked(values, by_stream[order[0]][0].dtype, bits, pairs=pairs)
        if pairs:
            rounded = paddle.unbind(rounded, 0)
        for j, stream in enumerate(order):
            storage.put(by_stream[stream][0], self.index, rounded[j])


def _stream(name, key):
    """The random stream of array `key` of parameter `name` ("": the parameter itself)."""
    return zlib.crc32(f"{name}.{key}".encode())
