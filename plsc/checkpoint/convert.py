"""Checkpoints made from checkpoints: re-sharding for another world size, the classifier out
as one array and back in, and a sub-centre head reduced to its dominant centres. Each copies
a slab of rows at a time (no whole second copy of a head array) into a temporary folder that
is renamed into place with its manifest."""
import copy
import os

import numpy as np
import paddle

from ..distributed import ClassPartition
from ..fileio import commit_folder, copy_file, temp_folder
from ..kernels.numerics import STORAGE_DTYPES, cast_nearest
from ..storage.int8 import INT8_MAPS, quantize
from ..storage.int4 import INT4_MAPS
from ..storage import STORED_DTYPES
from .head_arrays import (NPY_DTYPES, head_dtype, load_head_rows, records_of, rows_as_float32,
                          slab_rows, stream_npy)
from .layout import (BACKBONE, META, TRAINER, head_dir, head_file, is_state_of, read_meta,
                     write_meta)
from .manifest import write_manifest

__all__ = ["copy_checkpoint", "reshard_checkpoint", "convert_checkpoint", "export_classifier",
           "import_classifier", "write_k1_checkpoint"]



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
    even (bfloat16: its bits as uint16; 8 bits: records of each row's scale and codes, rounded
    to nearest from float32)."""
    if dtype in INT8_MAPS:
        codes, scale = quantize(paddle.to_tensor(_float32_round_to_odd(x)), dtype)
        return records_of(codes.numpy(), scale.numpy(), dtype)
    if dtype == "bfloat16":
        return cast_nearest(paddle.to_tensor(_float32_round_to_odd(x)), "bfloat16").numpy()
    return x.astype(NPY_DTYPES[dtype])


def _write_rows(file, count, fetch):
    """Write a `[count, ...]` .npy from `fetch(start, n)` (numpy rows), a slab at a time; its
    `FileRecord`."""
    first = fetch(0, 1)
    step = slab_rows(first.shape[1:], first.dtype.itemsize)
    return stream_npy(file, first.dtype, (count,) + first.shape[1:],
                       (fetch(lo, min(step, count - lo)) for lo in range(0, count, step)))


def copy_checkpoint(src, dst, meta, head_rows, replace=False):
    """Write checkpoint `dst` from `src`: same backbone and trainer state, the head
    arrays given by `head_rows(name, start, count)` (as stored) for `meta`'s partition,
    written a slab at a time, and a manifest. `meta["head_dtypes"]` is filled in for older
    checkpoints. An existing `dst` is an error unless `replace`."""
    if os.path.exists(dst) and not replace:
        raise FileExistsError(f"{dst} exists; choose a new output folder")
    meta = dict(meta, head_dtypes={n: head_dtype(src, n, meta) for n in meta["head_arrays"]},
                manifest=True)
    tmp = temp_folder(dst)
    records = {}
    for name in (BACKBONE, TRAINER):
        records[name] = copy_file(os.path.join(src, name), os.path.join(tmp, name))
    part = ClassPartition(meta["num_classes"], meta["world_size"])
    for r in range(part.world_size):
        os.makedirs(os.path.join(tmp, head_dir(r)))
        start = part.class_start(r)
        for name in meta["head_arrays"]:
            records[head_file(r, name)] = _write_rows(
                os.path.join(tmp, head_file(r, name)), part.num_local(r),
                lambda lo, n, name=name: head_rows(name, start + lo, n))
    records[META] = write_meta(tmp, meta)
    write_manifest(tmp, records)
    return commit_folder(tmp, dst)


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


def convert_checkpoint(src, dst, dtype):
    """Copy checkpoint `src` to `dst` with every head array stored as float `dtype` ("float32",
    "bfloat16" or "float16"): the weight, the bias and their optimizer state, from whatever
    they were (16, 8 or 4 bits, float32); float32 counters (AdamW's step counts) stay float32.
    The stored config says `Loss.param_dtype: dtype` and `Optimizer.head_state_dtype: null`.
    Values are converted exactly where the new dtype holds them (to float32 always), else
    rounded to nearest even."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"a checkpoint converts to one of {', '.join(STORAGE_DTYPES)}, "
                         f"got {dtype!r}")
    meta = read_meta(src)
    old = {name: head_dtype(src, name, meta) for name in meta["head_arrays"]}
    convertible = STORED_DTYPES
    new = {name: dtype if d in convertible and not name.endswith(".steps") else d
           for name, d in old.items()}
    out = dict(meta, head_dtypes=new)
    if isinstance(meta.get("config"), dict):
        cfg = copy.deepcopy(meta["config"])
        cfg.setdefault("Loss", {})["param_dtype"] = dtype
        cfg.setdefault("Optimizer", {})["head_state_dtype"] = None
        out["config"] = cfg

    def rows(name, start, count):
        stored = load_head_rows(src, name, start, count, meta)
        if new[name] == old[name]:
            return stored
        return _to_storage(rows_as_float32(stored, old[name]), new[name])

    return copy_checkpoint(src, dst, out, rows)


def export_classifier(src, path, name="weight"):
    """Write head array `name` of all classes as one `[C, ...]` .npy a plain numpy reads,
    streamed by slabs: a bfloat16, 8- or 4-bit array as float32 (bfloat16 exactly, 8 and 4
    bits the values the head computes with), float16 and float32 as stored."""
    meta = read_meta(src)
    dtype = head_dtype(src, name, meta)
    widen = dtype == "bfloat16" or dtype in INT8_MAPS or dtype in INT4_MAPS
    shape = (meta["num_classes"],) + \
        rows_as_float32(load_head_rows(src, name, 0, 1, meta), dtype).shape[1:]
    out = np.float32 if widen else NPY_DTYPES.get(dtype, dtype)
    step = slab_rows(shape[1:])

    def slab(lo):
        rows = load_head_rows(src, name, lo, min(step, shape[0] - lo), meta)
        return rows_as_float32(rows, dtype) if widen else rows

    stream_npy(path, out, shape, (slab(lo) for lo in range(0, shape[0], step)))
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
        replaced = any(is_state_of(name, n) for n in new)
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
    expect = (meta["num_classes"],) + rows_as_float32(load_head_rows(src, name, 0, 1, meta),
                                                      head_dtype(src, name, meta)).shape[1:]
    if array.dtype.kind != "f" or array.shape != expect:
        raise ValueError(f"{file} holds {array.dtype} of shape {array.shape}; expected a float "
                         f"array (float16, float32 or float64) of shape {expect} for {name!r} "
                         f"of checkpoint {src}")
    return array


def write_k1_checkpoint(src, dst, dominant, cfg=None, meta=None):
    """Checkpoint `dst` from the K-centre checkpoint `src`: each class's weight row is its
    dominant centre `dominant[c]` (the stored bits), the weight's optimizer state is zero,
    everything else (backbone, its optimizer, LR schedule, bias and its state) is copied;
    meta.json and its stored config (`cfg` when it has none) say `sub_centers: 1`, and a run
    mid-epoch goes on at the next epoch's start (a new data set). A previous `dst` is
    replaced."""
    meta = read_meta(src) if meta is None else meta
    k = int(meta.get("sub_centers", 1))
    new_meta = dict(meta, sub_centers=1)
    if new_meta.get("batch_in_epoch"):  # a new data set: start at the beginning of an epoch
        new_meta["epoch"] = int(new_meta.get("epoch", 0)) + 1
        new_meta["batch_in_epoch"] = 0
    stored_cfg = copy.deepcopy(meta.get("config") or cfg)
    if stored_cfg is not None:
        stored_cfg.setdefault("Loss", {})["sub_centers"] = 1
        new_meta["config"] = stored_cfg
    new_meta["cleaned_from"] = {"checkpoint": os.path.abspath(src), "sub_centers": k}
    dominant = np.asarray(dominant, np.int64)
    zeros_like_first = {}

    def rows(name, start, count):
        if name == "weight":
            centres = load_head_rows(src, name, start, count, meta)  # [count, K, d] as stored
            return centres[np.arange(count), dominant[start:start + count]]
        if is_state_of(name, "weight"):
            if name not in zeros_like_first:
                zeros_like_first[name] = load_head_rows(src, name, 0, 1, meta)
            first = zeros_like_first[name]  # [1, K, ...]
            rest = first.shape[2:]  # [1, K, 1]: a number per centre (AdamW's step count), 1-D at K = 1
            return np.zeros((count,) + (() if int(np.prod(rest)) == 1 else rest), first.dtype)
        return load_head_rows(src, name, start, count, meta)

    return copy_checkpoint(src, dst, new_meta, rows, replace=True)
