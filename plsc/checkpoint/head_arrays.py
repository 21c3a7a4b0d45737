"""The head's arrays in a checkpoint folder: one `.npy` per class-indexed array per rank.

    <checkpoint>/head_rank{r}/<name>.npy    rank r's rows of the weight, the bias and their
                                            optimizer state (partition in meta.json)

meta.json's `head_dtypes` maps each array to its dtype ("float32", "float16", "bfloat16", an
8-bit map of `plsc.storage.int8`: "int8", "int8_log", "uint8_log", or a 4-bit map of
`plsc.storage.int4`: "int4", "int4_log", "uint4_log"); numpy has no bfloat16, so a bfloat16
array's .npy holds its bits as uint16, and an 8-bit array's .npy holds a record a row, `(scale float32,
codes int8[d])` (uint8 codes for uint8_log; `[n]` records, `[n, K]` with sub-centres), so each
row's scale travels with its codes; a 4-bit row's record is `(scale float32[blocks],
codes uint8[d/2])`, its scales and its bytes as the head holds them. Checkpoints without
`head_dtypes` hold each array in its .npy's dtype.

Everything here streams: a save writes a tensor a slab of rows at a time (`save_rows_npy`),
a load fills a tensor in place a slab at a time from a checkpoint of any world size and
dtype (`load_head_rows_into`), and re-sharding, export and import copy slab by slab, so no
whole second copy of a head array exists. Files go through `plsc.fileio`'s atomic writer;
a damaged file (cut short, not a .npy, bad JSON) raises `CheckpointDamaged` naming it.
"""
import os

import numpy as np
import paddle

from ..distributed import ClassPartition
from ..fileio import AtomicWriter, write_npy
from .. import storage
from ..kernels.numerics import SLAB_BYTES, cast_nearest
from ..storage import int8 as quantized, int4 as quantized4
from ..storage.int8 import INT8_MAPS
from .errors import CheckpointDamaged
from .layout import head_file, read_meta
from .manifest import npy_problem

__all__ = ["array_dtype", "save_rows_npy", "write_rows_npy", "stream_npy", "slab_rows",
           "head_dtype", "load_head_rows", "load_head_rows_into", "rows_as_float32",
           "bfloat16_to_float32", "records_of", "head_array_bytes", "NPY_DTYPES"]


_SLAB_BYTES = SLAB_BYTES  # bytes of rows a streamed save or load copies at a time
# How each head array dtype is stored in a .npy (numpy has no bfloat16: its bits, as uint16).
NPY_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16,
               "float64": np.float64, "int64": np.int64}


def _quantized(name):
    """The module (`plsc.storage.int8` or `plsc.storage.int4`) of an 8- or 4-bit map, else None."""
    if name in INT8_MAPS:
        return quantized
    return quantized4 if name in quantized4.INT4_MAPS else None


def array_dtype(array):
    """"float32", "bfloat16", "int8", ... of a Paddle tensor, `Int8Rows` or numpy array."""
    if isinstance(array, np.ndarray):
        return array.dtype.name
    return storage.name(array)


def slab_rows(row_shape, itemsize=4):
    """Rows of `row_shape` in one slab of `_SLAB_BYTES` (at least 1)."""
    per_row = itemsize * int(np.prod(row_shape, dtype=np.int64))
    return max(1, _SLAB_BYTES // max(1, per_row))


def stream_npy(path, dtype, shape, slabs):
    """Write a `.npy` of `dtype` and `shape` from `slabs` (numpy row blocks in order),
    atomically, one block at a time; its `FileRecord`."""
    dtype = np.dtype(dtype)
    with AtomicWriter(path) as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                "shape": tuple(shape)})
        written = 0
        for slab in slabs:
            f.write(np.ascontiguousarray(slab, dtype=dtype).data)
            written += slab.shape[0]
        if written != shape[0]:
            raise ValueError(f"{path}: wrote {written} rows, expected {shape[0]}")
    return f.record


def head_array_bytes(array):
    """Bytes the `.npy` of head array `array` (Paddle tensor, `Int8Rows` or numpy) takes,
    header aside."""
    if isinstance(array, np.ndarray):
        return int(array.nbytes)
    return storage.nbytes(array)


def save_rows_npy(path, rows):
    """Write `rows` (a Paddle tensor or numpy array, `[n, ...]`) as a `.npy`, a slab of rows at
    a time: at no moment is there a whole host copy of it. Returns the dtype name written.

    Paddle float32/float16 become the same numpy dtype; bfloat16 is stored as its bits, a
    uint16 .npy (`head_dtypes` in meta.json tells them apart)."""
    return write_rows_npy(path, rows)[0]


def write_rows_npy(path, rows):
    """`save_rows_npy` returning (dtype name, the file's `FileRecord`)."""
    if isinstance(rows, np.ndarray):
        return rows.dtype.name, write_npy(path, rows)
    name = array_dtype(rows)
    if _quantized(name):  # records of (scale, codes)
        return name, _write_records(path, rows)
    if name not in NPY_DTYPES:
        raise TypeError(f"cannot save {path}: head arrays of dtype {rows.dtype} are not supported "
                        f"(expected one of {', '.join(NPY_DTYPES)})")
    dtype = np.dtype(NPY_DTYPES[name])
    shape = tuple(int(s) for s in rows.shape)
    step = slab_rows(shape[1:], dtype.itemsize)
    # index_select, not rows[lo:hi]: .numpy() of a sliced view copies the whole array
    # (measured: peak RSS + 1.0x its size). float16 rows move as bfloat16 bits (Paddle 3.3
    # has no float16/int16 index_select on CPU); the bytes are the same. bfloat16's
    # .numpy() is its bits as uint16.
    src = rows.view("bfloat16") if rows.dtype == paddle.float16 else rows
    return name, stream_npy(path, dtype, shape, (
        paddle.index_select(src, paddle.arange(lo, min(lo + step, shape[0]))).numpy().view(dtype)
        for lo in range(0, shape[0], step)))


def _write_records(path, rows):
    """8- or 4-bit rows as a .npy of records (scale, codes), a slab of rows at a time."""
    width = rows.shape[-1]
    dtype = _quantized(rows.map.name).record_dtype(rows.map.name, width)
    shape = tuple(rows.shape[:-1])
    step = slab_rows(shape[1:], dtype.itemsize)

    def slab(lo):
        index = paddle.arange(lo, min(lo + step, shape[0]))
        out = np.empty((int(index.shape[0]),) + shape[1:], dtype)
        # gather, not rows[lo:hi]: .numpy() of a sliced view copies the whole array
        out["codes"] = paddle.gather(rows.codes, index).numpy()
        out["scale"] = paddle.gather(rows.scale, index).numpy()
        return out
    return stream_npy(path, dtype, shape, (slab(lo) for lo in range(0, shape[0], step)))


def bfloat16_to_float32(bits):
    """uint16 bfloat16 bits -> float32 values (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def rows_as_float32(rows, stored):
    """Host rows as a checkpoint stores head dtype `stored` (bfloat16: uint16 bits; 8 and 4
    bits: records) -> float32 values (exact for 16 bits; 8 and 4 bits: as the head reads them)."""
    if _quantized(stored):
        return _records_f32(rows, stored).numpy()
    return bfloat16_to_float32(rows) if stored == "bfloat16" else rows.astype(np.float32)


def _records_f32(rows, stored):
    """8- or 4-bit records -> float32 Paddle tensor (their map's `dequantize`, as the head
    reads)."""
    return _quantized(stored).dequantize(paddle.to_tensor(np.ascontiguousarray(rows["codes"])),
                      paddle.to_tensor(np.ascontiguousarray(rows["scale"])), stored)


def records_of(codes, scale, name):
    """Host 8-bit records of map `name` from numpy codes `[n, ..., d]` and scales `[n, ...]`."""
    out = np.empty(scale.shape, quantized.record_dtype(name, codes.shape[-1]))
    out["codes"], out["scale"] = codes, scale
    return out


def _values_f32(rows, stored):
    """Host rows stored as head dtype `stored` -> their float32 values, a Paddle tensor."""
    if _quantized(stored):
        return _records_f32(rows, stored)
    return paddle.to_tensor(rows_as_float32(rows, stored))


def _to_tensor(rows, stored, dtype):
    """Host rows stored as head dtype `stored` -> a Paddle tensor of `dtype` (float32: exact;
    16 bits: rounded to nearest even)."""
    if stored == dtype:
        return paddle.to_tensor(rows)  # uint16 -> bfloat16: the same bits
    return cast_nearest(_values_f32(rows, stored), dtype)


def _write_into(target, offset, rows, stored):
    """Host rows stored as `stored` written into rows offset … of head array `target`."""
    n = rows.shape[0]
    if stored != storage.name(target):  # its float32 values, rounded to nearest
        storage.put(target, offset, _values_f32(rows, stored))
    elif _quantized(stored):  # the stored codes and scales, as they are
        target.codes[offset:offset + n] = paddle.to_tensor(np.ascontiguousarray(rows["codes"]))
        target.scale[offset:offset + n] = paddle.to_tensor(np.ascontiguousarray(rows["scale"]))
    else:  # the stored bits, as they are
        target[offset:offset + n] = _to_tensor(rows, stored, stored)


def _map_npy(file):
    """`np.load(file, mmap_mode="r")`; `CheckpointDamaged` for a cut or foreign file."""
    try:
        return np.load(file, mmap_mode="r")
    except (ValueError, OSError, EOFError) as err:
        raise CheckpointDamaged(file, npy_problem(file) or str(err)) from None


def head_dtype(path, name, meta=None):
    """Dtype name of head array `name` of checkpoint `path`: meta.json's `head_dtypes`, or
    (older checkpoints) the dtype of its rank-0 .npy."""
    meta = read_meta(path) if meta is None else meta
    if name not in meta["head_arrays"]:
        raise KeyError(f"checkpoint {path} has no head array {name!r}; it has "
                       f"{meta['head_arrays']}")
    if name in meta.get("head_dtypes", {}):
        return meta["head_dtypes"][name]
    return _map_npy(_head_file(path, 0, name)).dtype.name


def _head_file(path, rank, name):
    file = os.path.join(path, head_file(rank, name))
    if not os.path.isfile(file):
        raise FileNotFoundError(f"checkpoint {path} lacks {file}")
    return file


def _expected(dtype, row_shape, found):
    """(numpy dtype, row shape or None) a .npy of head dtype `dtype` holds for values of
    `row_shape` (8 bits: records of the row's codes; their width from `found` when unknown)."""
    module = _quantized(dtype)
    if module is None:
        return np.dtype(NPY_DTYPES.get(dtype, dtype)), row_shape
    if row_shape is None:
        codes = found.fields.get("codes") if found.names else None
        width = codes[0].shape[0] if codes and codes[0].shape else 0
        return module.record_dtype(dtype, width * (2 if module is quantized4 else 1)), None
    return module.record_dtype(dtype, row_shape[-1]), tuple(row_shape[:-1])


def _open_rows(file, dtype, count, row_shape=None):
    """Memory-mapped `file`, checked: `count` rows (of `row_shape` values if given) stored as
    `dtype`."""
    rows = _map_npy(file)
    expect, npy_rows = _expected(dtype, row_shape, rows.dtype)
    ok = (rows.ndim >= 1 and rows.shape[0] == count and rows.dtype == expect
          and (npy_rows is None or tuple(rows.shape[1:]) == tuple(npy_rows)))
    if not ok:
        want = (count,) + tuple(npy_rows) if npy_rows is not None else f"{count} rows"
        raise ValueError(f"{file} holds {rows.dtype} of shape {rows.shape}; expected {dtype} "
                         f"(stored as {expect}) of shape {want}")
    return rows


def _head_pieces(path, meta, name, class_start, count, row_shape=None):
    """(file, first row, stop row, offset in the result) of the checked shards holding rows
    [class_start, class_start + count) of head array `name`, whatever the world size."""
    part = ClassPartition(meta["num_classes"], meta["world_size"])
    stop = class_start + count
    if class_start < 0 or count < 0 or stop > part.num_classes:
        raise ValueError(f"rows [{class_start}, {stop}) are outside the {part.num_classes} "
                         f"classes of checkpoint {path}")
    dtype = head_dtype(path, name, meta)
    for r in range(part.world_size):
        lo = part.class_start(r)
        hi = lo + part.num_local(r)
        if hi <= class_start or lo >= stop:
            continue
        file = _head_file(path, r, name)
        _open_rows(file, dtype, hi - lo, row_shape)
        a, b = max(class_start, lo), min(stop, hi)
        yield file, a - lo, b - lo, a - class_start


def _read_rows(file, lo, hi):
    """Rows [lo, hi) of the .npy `file`, through a mapping closed right away (the touched pages
    of a mapping kept open count in RSS: +0.75x the array when loading it, measured)."""
    return np.array(_map_npy(file)[lo:hi])


def load_head_rows(path, name, class_start, num_local, meta=None):
    """Rows [class_start, class_start + num_local) of head array `name` as stored (bfloat16:
    uint16 bits, see `head_dtype`), whatever the world size the checkpoint was written with.
    `meta`: the checkpoint's meta.json, when the caller has read it already."""
    meta = read_meta(path) if meta is None else meta
    return np.concatenate([_read_rows(file, lo, hi) for file, lo, hi, _ in
                           _head_pieces(path, meta, name, class_start, num_local)])


def load_head_rows_into(path, name, class_start, tensor, meta=None):
    """Fill `tensor` (Paddle, `[n, ...]`, float32/bfloat16/float16, or 8- or 4-bit rows) in place
    with rows [class_start, class_start + n) of head array `name`, from a checkpoint of any
    world size, a slab at a time (memory-mapped reads; no second copy of the array).

    A stored bfloat16 or float16 becomes float32 exactly; float32 becomes 16 bits rounded to
    nearest even; 8-bit rows of the tensor's map are copied as stored, any other stored dtype
    is quantised to nearest (8- or 4-bit rows of another map, too: their float32 values);
    8- and 4-bit rows go into a float tensor as their float32 values."""
    meta = read_meta(path) if meta is None else meta
    stored, dtype = head_dtype(path, name, meta), array_dtype(tensor)
    known = storage.STORED_DTYPES
    if stored != dtype and not (stored in known and dtype in known):
        raise TypeError(f"cannot load head array {name!r} of checkpoint {path} (stored as "
                        f"{stored}) into a {dtype} tensor; expected one of {', '.join(known)}")
    row_shape = tuple(int(d) for d in tensor.shape[1:])
    step = slab_rows(row_shape)
    with paddle.no_grad():
        for file, lo, hi, offset in _head_pieces(path, meta, name, class_start,
                                                 int(tensor.shape[0]), row_shape):
            for a in range(lo, hi, step):
                b = min(a + step, hi)
                _write_into(tensor, offset + a - lo, _read_rows(file, a, b), stored)
    return tensor
