"""The head's row arrays behind one interface, whatever they are stored as.

A head array (class centres, their bias, optimizer state) is a Paddle tensor of float32,
bfloat16 or float16, an 8-bit `Int8Rows` (`int8.py`: codes and a scale per row), or (optimizer
state) its 4-bit form `Int4Rows` (`int4.py`, its tables and numpy kernels in `int4_tables.py`:
two codes a byte, a scale per block). This module is the interface; one module a stored form
holds the rest. All arithmetic is float32: callers read rows as float32 (`read`, `take`),
compute, and write float32 rows back (`put`), which rounds them into the storage (to nearest;
stochastically when the caller gives random bits, see `put`). No caller asks which storage it holds.

Slabs: passes over many rows go a slab at a time, sized from a byte budget of float32 rows
(`slab_rows`): `SLAB_BYTES` (32 MiB) for the CPU kernel set, where a slab should stay near the
caches, and `DEVICE_SLAB_BYTES` (256 MiB) for the device set (Paddle ops; a GPU, or
`PLSC_KERNELS=device`), where a slab should be as large as memory allows because every slab
costs the same fixed number of kernel launches: 131,072 rows of width 512, so the optimizer
update of a Partial FC step is one slab up to that many sampled rows. The budget counts one
float32 copy of the slab's rows; an update's temporaries are a few such copies.

Which kernels serve a tensor (numpy on the CPU, Paddle ops elsewhere) is
`plsc.kernels.cpu_kernels.cpu_set`'s choice, the one place it is made.
"""
import paddle

from ..dtypes import HEAD_DTYPES, STATE_DTYPES, STORED_DTYPES
from ..kernels.cpu_kernels import all_finite, cpu_set, take_rows
from ..kernels.numerics import DEVICE_SLAB_BYTES, SLAB_BYTES, cast_nearest, to_float32
from .int8 import Int8Rows
from .int4 import Int4Rows

__all__ = ["HEAD_DTYPES", "STATE_DTYPES", "STORED_DTYPES", "SLAB_BYTES", "DEVICE_SLAB_BYTES", "name",
           "is_float32", "has_autograd", "zeros", "read", "take", "take_stored", "put", "nbytes",
           "slab_rows", "kept", "value_parts", "as_array", "row_ids", "gather_rows", "all_rows_finite"]


def name(t):
    """'float32', 'bfloat16', 'float16', or the 8- or 4-bit map ('int8', 'int8_log',
    'uint8_log', 'int4', 'int4_log', 'uint4_log') of a head array."""
    if isinstance(t, Int8Rows):
        return t.map.name
    return str(t.dtype).replace("paddle.", "")


def is_float32(t):
    """Whether `t` is stored as float32 (then `read` returns it, or a view, as it is)."""
    return name(t) == "float32"


def has_autograd(t):
    """Whether `t` is a Paddle tensor autograd can give a gradient (8-bit rows are not)."""
    return not isinstance(t, Int8Rows)


def zeros(shape, dtype, map_name=None):
    """A zero head array of `shape` stored as `dtype` (one of `STATE_DTYPES`; "int8" and "int4"
    with the map `map_name`, default the linear "int8" and "int4", and only for rows of two or
    more axes: one value per row stays float32)."""
    if dtype not in STATE_DTYPES:
        raise ValueError(f"storage dtype must be one of {', '.join(STATE_DTYPES)}, got {dtype!r}")
    if dtype in ("int8", "int4"):
        if len(shape) < 2:
            return paddle.zeros(shape, dtype="float32")
        if dtype == "int4":
            return Int4Rows.zeros(list(shape), map_name or "int4")
        return Int8Rows.zeros(list(shape), map_name or "int8")
    return paddle.zeros(shape, dtype=dtype)


def read(t, start=0, stop=None):
    """Rows [start, stop) of `t` as float32 (a view of float32 storage)."""
    if isinstance(t, Int8Rows):
        return t.rows(start, stop)
    return to_float32(t[start:stop] if (start, stop) != (0, None) else t)


def take(t, index):
    """Rows `index` (int64 `[k]`) of `t` as float32."""
    if isinstance(t, Int8Rows):
        return t.take(index)
    return to_float32(gather_rows(t, index))


def take_stored(t, index):
    """Rows `index` of `t` in `t`'s own storage (8 and 4 bits: their codes and scales), no
    float32 copy."""
    return t.subset(index) if isinstance(t, Int8Rows) else gather_rows(t, index)


def gather_rows(t, index):
    """Rows `index` of the tensor `t`, in `t`'s dtype: 16-bit rows move as int16 on the CPU
    set (its numpy kernel) and for float16 on the CPU (Paddle 3.3 has no CPU float16 gather)."""
    if t.dtype == paddle.bfloat16 and not cpu_set(t):
        return paddle.gather(t, index)
    if t.dtype in (paddle.bfloat16, paddle.float16):
        return take_rows(t.view("int16"), index).view(t.dtype)
    return take_rows(t, index)


def row_ids(where, count, place):
    """The global row indices of rows `where` (an int start, or an int64 index) of `count`
    rows: what stochastic rounding's bits depend on."""
    if isinstance(where, int):
        return paddle.arange(where, where + count, dtype="int64").to(place)
    return where


def put(t, where, values, bits=None, keep=None):
    """Store float32 `values` ([k, ...]) in rows `where` of `t`: rows where..where+k for an int,
    or the rows of an int64 index `[k]` (an index may repeat a row only with equal values).

    Rounded to nearest, or stochastically with `bits`: an object whose `round(values, dtype,
    rows)` gives 16-bit values and whose `noise(rows, width)` gives uniform [0, 1) noise for
    8-bit codes (`plsc.optim.rounding.StochasticBits`), `rows` the global row indices. float32
    storage takes `values` as they are, and so does any storage for values already of its
    dtype (rounded by the caller), or, for 16-bit rows of even width at an index, int32
    `[k, width / 2]` holding such values' bits in pairs (the device set's batched rounding
    hands them over so). `keep`: a 0-d bool tensor; where true, the rows keep their
    stored bits (float32 values only: they are replaced by the stored ones, `kept`), decided
    on the device."""
    if isinstance(t, Int8Rows):
        noise = None
        if bits is not None:
            noise = bits.noise(row_ids(where, values.shape[0], values.place),
                               values.size // max(1, values.shape[0])).reshape(values.shape)
        t.write(where, values, noise, keep=keep)
        return
    if values.dtype == paddle.int32 and t.dtype in (paddle.bfloat16, paddle.float16):
        if keep is not None or isinstance(where, int) or t.ndim != 2 \
                or 2 * values.shape[-1] != t.shape[1]:
            raise ValueError("put: int32 pairs of 16-bit values need an index, 2-D rows, no keep")
        t.view("int32").scatter_(where, values, overwrite=True)
        return
    if values.dtype == paddle.float32:
        values = kept(t, where, values, keep)
    elif keep is not None:
        raise ValueError("put: keep needs float32 values (apply it before rounding: kept)")
    if values.dtype != t.dtype:
        values = cast_nearest(values, t.dtype) if bits is None else \
            bits.round(values, t.dtype, row_ids(where, values.shape[0], values.place))
    if isinstance(where, int):
        t[where:where + values.shape[0]] = values
    elif t.dtype == paddle.float32:
        t.scatter_(where, values, overwrite=True)
    elif t.ndim == 2 and t.shape[1] % 2 == 0:
        # No 16-bit CPU scatter in Paddle 3.3: scatter pairs of 16-bit values as int32.
        t.view("int32").scatter_(where, values.view("int32"), overwrite=True)
    else:  # index_put_ is slow on rows of a 2-D tensor, fast on 1-D (docs/performance.md)
        t.index_put_((where,), values)


def kept(t, where, values, keep, old=None):
    """float32 `values` for rows `where` of `t`, or (where the bool `keep`, 0-d or of
    `values`' shape, is true) the float32 values those rows hold now (exact: the storage's
    values upcast), as `put` writes them; `keep` None: `values`. `old`: those values, read
    already (then `t` is not read)."""
    if keep is None:
        return values
    if old is None:
        n = values.shape[0]
        old = read(t, where, where + n) if isinstance(where, int) else take(t, where)
    return paddle.where(keep, old, values)


def as_array(value):
    """A head array from a state-dict value: 8-bit rows as they are, anything else (a tensor,
    a numpy array) as a Paddle tensor."""
    return value if isinstance(value, Int8Rows) else paddle.to_tensor(value)


def nbytes(t):
    """Bytes `t` occupies (8 bits: codes and scales)."""
    if isinstance(t, Int8Rows):
        return t.nbytes
    return int(t.size) * int(t.element_size())


def slab_rows(width, *tensors, budget=None):
    """Rows of `width` float32 values in one slab (at least 1): the budget of the kernel set
    serving `tensors` (`SLAB_BYTES` on the CPU set, `DEVICE_SLAB_BYTES` on the device set),
    or `budget` bytes."""
    if budget is None:
        budget = SLAB_BYTES if cpu_set(*[_tensor(t) for t in tensors]) else DEVICE_SLAB_BYTES
    return max(1, int(budget) // (4 * max(1, int(width))))


def _tensor(t):
    return t.codes if isinstance(t, Int8Rows) else t


def value_parts(t):
    """The Paddle tensors whose values decide whether `t`'s are all finite (8-bit rows: their
    scales, NaN for a row that held a NaN or an infinity)."""
    return t.scale if isinstance(t, Int8Rows) else t



def all_rows_finite(arrays):
    """Whether every value of `arrays` (head arrays, or any tensors) is finite, as a Python
    bool: floats of any width are read a slab of rows at a time as float32, 8-bit rows by
    their scales; integer arrays are finite."""
    for t in arrays:
        t = value_parts(t)
        if not paddle.is_floating_point(t) or t.size == 0:
            continue
        if t.ndim == 0 or t.dtype == paddle.float32:
            if not all_finite(t):
                return False
            continue
        step = max(1, SLAB_BYTES // (4 * max(1, t.size // t.shape[0])))
        for lo in range(0, t.shape[0], step):
            if not all_finite(to_float32(t[lo:lo + step])):
                return False
    return True
