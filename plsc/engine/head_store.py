"""The head's arrays in a checkpoint folder: one `.npy` per class-indexed array per rank.

    <checkpoint>/head_rank{r}/<name>.npy    rank r's rows of the weight, the bias and their
                                            optimizer state (partition in meta.json)

meta.json's `head_dtypes` maps each array to its dtype ("float32", "float16", "bfloat16");
numpy has no bfloat16, so a bfloat16 array's .npy holds its bits as uint16. Checkpoints
without `head_dtypes` hold each array in its .npy's dtype.

Everything here streams: a save writes a tensor a slab of rows at a time (`save_rows_npy`),
a load fills a tensor in place a slab at a time from a checkpoint of any world size and
dtype (`load_head_rows_into`), and re-sharding, export and import copy slab by slab, so no
whole second copy of a head array exists. Files go through `plsc.fileio`'s atomic writer;
a damaged file (cut short, not a .npy, bad JSON) raises `CheckpointDamaged` naming it.
"""
import json
import os
import shutil

import numpy as np
import paddle

from ..distributed import ClassPartition
from ..fileio import AtomicWriter, atomic_write, copy_file
from ..numerics import STORAGE_DTYPES, cast_nearest
from .manifest import CheckpointDamaged, npy_problem, read_json, write_manifest

__all__ = ["read_meta", "array_dtype", "save_rows_npy", "write_rows_npy", "head_dtype",
           "load_head_rows", "load_head_rows_into", "reshard_checkpoint", "export_classifier",
           "import_classifier", "copy_checkpoint", "rows_as_float32", "head_array_bytes"]


def _save_npy(path, array):
    with AtomicWriter(path) as f:
        np.save(f, array)
    return f.record


_SLAB_BYTES = 32 << 20  # rows a streamed save or load copies at a time
# How each head array dtype is stored in a .npy (numpy has no bfloat16: its bits, as uint16).
_NPY_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16,
               "float64": np.float64, "int64": np.int64}


def array_dtype(array):
    """"float32", "bfloat16", ... of a Paddle tensor or numpy array."""
    if isinstance(array, np.ndarray):
        return array.dtype.name
    return str(array.dtype).replace("paddle.", "")


def _slab_rows(row_shape, itemsize=4):
    """Rows of `row_shape` in one slab of `_SLAB_BYTES` (at least 1)."""
    per_row = itemsize * int(np.prod(row_shape, dtype=np.int64))
    return max(1, _SLAB_BYTES // max(1, per_row))


def _stream_npy(path, dtype, shape, slabs):
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
    """Bytes the `.npy` of head array `array` (Paddle tensor or numpy) takes, header aside."""
    return int(np.prod(array.shape, dtype=np.int64)) * int(
        array.dtype.itemsize if isinstance(array, np.ndarray) else array.element_size())


def save_rows_npy(path, rows):
    """Write `rows` (a Paddle tensor or numpy array, `[n, ...]`) as a `.npy`, a slab of rows at
    a time: at no moment is there a whole host copy of it. Returns the dtype name written.

    Paddle float32/float16 become the same numpy dtype; bfloat16 is stored as its bits, a
    uint16 .npy (`head_dtypes` in meta.json tells them apart)."""
    return write_rows_npy(path, rows)[0]


def write_rows_npy(path, rows):
    """`save_rows_npy` returning (dtype name, the file's `FileRecord`)."""
    if isinstance(rows, np.ndarray):
        return rows.dtype.name, _save_npy(path, rows)
    name = array_dtype(rows)
    if name not in _NPY_DTYPES:
        raise TypeError(f"cannot save {path}: head arrays of dtype {rows.dtype} are not supported "
                        f"(expected one of {', '.join(_NPY_DTYPES)})")
    dtype = np.dtype(_NPY_DTYPES[name])
    shape = tuple(int(s) for s in rows.shape)
    step = _slab_rows(shape[1:], dtype.itemsize)
    # index_select, not rows[lo:hi]: .numpy() of a sliced view copies the whole array
    # (measured: peak RSS + 1.0x its size). float16 rows move as bfloat16 bits (Paddle 3.3
    # has no float16/int16 index_select on CPU); the bytes are the same. bfloat16's
    # .numpy() is its bits as uint16.
    src = rows.view("bfloat16") if rows.dtype == paddle.float16 else rows
    return name, _stream_npy(path, dtype, shape, (
        paddle.index_select(src, paddle.arange(lo, min(lo + step, shape[0]))).numpy().view(dtype)
        for lo in range(0, shape[0], step)))


def _bfloat16_to_float32(bits):
    """uint16 bfloat16 bits -> float32 values (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def rows_as_float32(rows, stored):
    """Host rows as a checkpoint stores head dtype `stored` (bfloat16: uint16 bits) -> float32
    values (exact)."""
    return _bfloat16_to_float32(rows) if stored == "bfloat16" else rows.astype(np.float32)


def _float32_round_to_odd(x):
    """Float rows as float32; float64 is rounded to odd (truncated, last bit set if inexact),
    so that a later rounding to 16 bits rounds as if straight from float64."""
    if x.dtype.itemsize <= 4:
        return x.astype(np.float32)
    with np.errstate(over="ignore"):
        y = x.astype(np.float32)
    away = np.abs(y.astype(np.float64)) > np.abs(x)  # rounded away from zero: step back
    y = np.where(away, np.nextafter(y, np.float32(0)), y)
    inexact = (y.astype(np.float64) != x).astype(np.uint32)
    return (y.view(np.uint32) | inexact).view(np.float32)


def _to_storage(x, dtype):
    """Float rows `x` (numpy) as a checkpoint stores head dtype `dtype`, rounded to nearest
    even (bfloat16: its bits as uint16)."""
    if dtype == "bfloat16":
        return cast_nearest(paddle.to_tensor(_float32_round_to_odd(x)), "bfloat16").numpy()
    return x.astype(_NPY_DTYPES[dtype])


def _to_tensor(rows, stored, dtype):
    """Host rows stored as head dtype `stored` -> a Paddle tensor of `dtype` (float32: exact;
    16 bits: rounded to nearest even)."""
    if stored == dtype:
        return paddle.to_tensor(rows)  # uint16 -> bfloat16: the same bits
    return cast_nearest(paddle.to_tensor(rows_as_float32(rows, stored)), dtype)


def read_meta(path):
    """The checkpoint's meta.json; `CheckpointDamaged` when it does not parse."""
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint: {meta_path} is missing")
    meta = read_json(meta_path)
    if not isinstance(meta, dict):
        raise CheckpointDamaged(meta_path, f"expected a JSON object, found {type(meta).__name__}")
    return meta


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
    file = os.path.join(path, f"head_rank{rank}", f"{name}.npy")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"checkpoint {path} lacks {file}")
    return file


def _open_rows(file, dtype, count, row_shape=None):
    """Memory-mapped `file`, checked: `count` rows (of `row_shape` if given) stored as `dtype`."""
    rows = _map_npy(file)
    expect = np.dtype(_NPY_DTYPES.get(dtype, dtype))
    ok = (rows.ndim >= 1 and rows.shape[0] == count and rows.dtype == expect
          and (row_shape is None or tuple(rows.shape[1:]) == tuple(row_shape)))
    if not ok:
        want = (count,) + tuple(row_shape) if row_shape is not None else f"{count} rows"
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
    """Fill `tensor` (Paddle, `[n, ...]`, float32/bfloat16/float16) in place with rows
    [class_start, class_start + n) of head array `name`, from a checkpoint of any world size,
    a slab at a time (memory-mapped reads; no second copy of the array).

    A stored bfloat16 or float16 becomes float32 exactly; float32 becomes 16 bits rounded to
    nearest even."""
    meta = read_meta(path) if meta is None else meta
    stored, dtype = head_dtype(path, name, meta), array_dtype(tensor)
    if stored != dtype and not (stored in STORAGE_DTYPES and dtype in STORAGE_DTYPES):
        raise TypeError(f"cannot load head array {name!r} of checkpoint {path} (stored as "
                        f"{stored}) into a {dtype} tensor; expected float32, bfloat16 or float16")
    row_shape = tuple(int(d) for d in tensor.shape[1:])
    step = _slab_rows(row_shape)
    with paddle.no_grad():
        for file, lo, hi, offset in _head_pieces(path, meta, name, class_start,
                                                 int(tensor.shape[0]), row_shape):
            for a in range(lo, hi, step):
                b = min(a + step, hi)
                tensor[offset + a - lo:offset + b - lo] = _to_tensor(_read_rows(file, a, b),
                                                                     stored, dtype)
    return tensor


def _write_rows(file, count, fetch):
    """Write a `[count, ...]` .npy from `fetch(start, n)` (numpy rows), a slab at a time; its
    `FileRecord`."""
    first = fetch(0, 1)
    step = _slab_rows(first.shape[1:], first.dtype.itemsize)
    return _stream_npy(file, first.dtype, (count,) + first.shape[1:],
                       (fetch(lo, min(step, count - lo)) for lo in range(0, count, step)))


def copy_checkpoint(src, dst, meta, head_rows):
    """Write checkpoint `dst` from `src`: same backbone and trainer state, the head
    arrays given by `head_rows(name, start, count)` (as stored) for `meta`'s partition,
    written a slab at a time, and a manifest. `meta["head_dtypes"]` is filled in for older
    checkpoints."""
    if os.path.exists(dst):
        raise FileExistsError(f"{dst} exists; choose a new output folder")
    meta = dict(meta, head_dtypes={n: head_dtype(src, n, meta) for n in meta["head_arrays"]},
                manifest=True)
    tmp = dst.rstrip("/") + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    records = {}
    for name in ("backbone.pdparams", "trainer.pdstates"):
        records[name] = copy_file(os.path.join(src, name), os.path.join(tmp, name))
    part = ClassPartition(meta["num_classes"], meta["world_size"])
    for r in range(part.world_size):
        os.makedirs(os.path.join(tmp, f"head_rank{r}"))
        start = part.class_start(r)
        for name in meta["head_arrays"]:
            records[f"head_rank{r}/{name}.npy"] = _write_rows(
                os.path.join(tmp, f"head_rank{r}", f"{name}.npy"), part.num_local(r),
                lambda lo, n, name=name: head_rows(name, start + lo, n))
    records["meta.json"] = atomic_write(os.path.join(tmp, "meta.json"),
                                        json.dumps(meta, indent=1))
    write_manifest(tmp, records)
    os.replace(tmp, dst)
    return dst


def reshard_checkpoint(src, dst, world_size):
    """Copy checkpoint `src` to `dst` with the head split for `world_size` ranks: the stored
    bits are copied, the dtypes (`head_dtypes`) kept.

    RNG states are per rank and are not carried over (the resumed run seeds anew).
    """
    src_meta = read_meta(src)
    part = ClassPartition(src_meta["num_classes"], world_size)  # raises for an impossible split
    meta = dict(src_meta, world_size=int(world_size), shard_size=part.shard_size)
    return copy_checkpoint(src, dst, meta, lambda name, start, count: load_head_rows(
        src, name, start, count, src_meta))


def export_classifier(src, path, name="weight"):
    """Write head array `name` of all classes as one `[C, ...]` .npy a plain numpy reads,
    streamed by slabs: a bfloat16 array as float32 (exact), float16 and float32 as stored."""
    meta = read_meta(src)
    dtype = head_dtype(src, name, meta)
    shape = (meta["num_classes"],) + load_head_rows(src, name, 0, 1, meta).shape[1:]
    out = np.float32 if dtype == "bfloat16" else _NPY_DTYPES.get(dtype, dtype)
    step = _slab_rows(shape[1:])

    def slab(lo):
        rows = load_head_rows(src, name, lo, min(step, shape[0] - lo), meta)
        return _bfloat16_to_float32(rows) if dtype == "bfloat16" else rows

    _stream_npy(path, out, shape, (slab(lo) for lo in range(0, shape[0], step)))
    return path


def import_classifier(src, dst, weight_path, bias_path=None):
    """Copy checkpoint `src` to `dst` with the classifier (and bias) read from float .npy files
    of all classes (float16, float32 or float64), stored in the checkpoint's dtype for that
    array (16 bits: rounded to nearest even). The optimizer state of the replaced arrays
    restarts from zero."""
    meta = read_meta(src)
    new = {"weight": weight_path} if bias_path is None else \
        {"weight": weight_path, "bias": bias_path}
    for name, file in new.items():
        new[name] = _open_import(src, meta, name, file)

    def rows(name, start, count):
        if name in new:
            return _to_storage(np.asarray(new[name][start:start + count]),
                               head_dtype(src, name, meta))
        old = load_head_rows(src, name, start, count, meta)
        replaced = any(name.startswith(f"opt.{n}.") for n in new)
        return np.zeros_like(old) if replaced else old

    return copy_checkpoint(src, dst, meta, rows)


def _open_import(src, meta, name, file):
    """The memory-mapped float array in `file` for head array `name` of checkpoint `src`."""
    if name not in meta["head_arrays"]:
        raise KeyError(f"checkpoint {src} has no head array {name!r}")
    try:
        array = np.load(file, mmap_mode="r")
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"{file} is not a readable .npy array ({err})") from None
    expect = (meta["num_classes"],) + load_head_rows(src, name, 0, 1, meta).shape[1:]
    if array.dtype.kind != "f" or array.shape != expect:
        raise ValueError(f"{file} holds {array.dtype} of shape {array.shape}; expected a float "
                         f"array (float16, float32 or float64) of shape {expect} for {name!r} "
                         f"of checkpoint {src}")
    return array
