"""Checkpoints that survive a kill in the middle of a save and a change of world size.

Layout of `<output_dir>/checkpoints/step_00001234/`:

    meta.json                  step, epoch, partition, world size, ... (written last)
    backbone.pdparams          backbone weights and buffers (rank 0)
    trainer.pdstates           backbone optimizer + LR schedule + loss scaler (rank 0)
    rng_rank{r}.pkl            Python, NumPy and Paddle RNG states of rank r
    head_rank{r}/<name>.npy    rank r's rows of every class-indexed array: the
                               weight, the bias and their optimizer state

Every rank writes into `step_XXXXXXXX.tmp`; after a barrier rank 0 renames
the folder and rewrites `latest`; a folder without `meta.json` or ending in
`.tmp` is never loaded. Head arrays are `.npy` so that loading on another
number of ranks reads only the rows a rank owns (memory-mapped).
"""
import json
import os
import pickle
import random
import re
import shutil

import numpy as np
import paddle

from ..distributed import ClassPartition, barrier, get_rank, get_world_size

__all__ = ["CheckpointManager", "find_checkpoint", "read_meta", "load_head_rows", "capture_rng",
           "restore_rng", "portable_optimizer_state", "local_optimizer_state", "reshard_checkpoint",
           "export_classifier", "import_classifier", "save_best"]

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def capture_rng():
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "paddle": paddle.get_rng_state()}


def restore_rng(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    paddle.set_rng_state(state["paddle"])


def _rename_keys(state, mapping):
    """Rename each key that starts with a mapped name (longest match), recursively."""
    names = sorted(mapping, key=len, reverse=True)
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            value = _rename_keys(value, mapping)
        for name in names:
            if key == name or key.startswith(name + "_"):
                key = mapping[name] + key[len(name):]
                break
        out[key] = value
    return out


def portable_optimizer_state(state, model):
    """A Paddle optimizer state keyed by the model's structured parameter names
    (`fc.weight_velocity_0`) instead of the process's generated ones (`linear_3.w_0_...`)."""
    return _rename_keys(state, {p.name: f"@{n}" for n, p in model.named_parameters()})


def local_optimizer_state(state, model):
    """The inverse of `portable_optimizer_state` for this process's model."""
    return _rename_keys(state, {f"@{n}": p.name for n, p in model.named_parameters()})


def _atomic_write(path, write):
    tmp = path + ".part"
    write(tmp)
    os.replace(tmp, path)


def _write_bytes(path, data):
    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)
    _atomic_write(path, write)


def _save_npy(path, array):
    def write(tmp):
        with open(tmp, "wb") as f:
            np.save(f, array)
    _atomic_write(path, write)


def read_meta(path):
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint: {meta_path} is missing")
    with open(meta_path, encoding="utf-8") as f:
        return json.load(f)


def find_checkpoint(path, output_dir):
    """Resolve 'latest' (newest complete checkpoint under output_dir) or check a path."""
    if path == "latest":
        root = os.path.join(output_dir, "checkpoints")
        done = sorted(d for d in (os.listdir(root) if os.path.isdir(root) else ())
                      if _STEP_DIR.match(d) and os.path.isfile(os.path.join(root, d, "meta.json")))
        if not done:
            raise FileNotFoundError(f"Global.checkpoint=latest but {root} holds no complete checkpoint")
        return os.path.join(root, done[-1])
    read_meta(path)
    return path


def load_head_rows(path, name, class_start, num_local):
    """Rows [class_start, class_start + num_local) of head array `name`, whatever the
    world size the checkpoint was written with."""
    meta = read_meta(path)
    part = ClassPartition(meta["num_classes"], meta["world_size"])
    stop = class_start + num_local
    pieces = []
    for r in range(part.world_size):
        lo = part.class_start(r)
        hi = lo + part.num_local(r)
        if hi <= class_start or lo >= stop:
            continue
        file = os.path.join(path, f"head_rank{r}", f"{name}.npy")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"checkpoint {path} lacks {file}")
        rows = np.load(file, mmap_mode="r")
        if rows.shape[0] != hi - lo:
            raise ValueError(f"{file} has {rows.shape[0]} rows, the partition says {hi - lo}")
        pieces.append(np.asarray(rows[max(class_start, lo) - lo:min(stop, hi) - lo]))
    return np.concatenate(pieces)


class CheckpointManager:
    """Saves and restores the whole training state; keeps the last `keep_last`."""

    def __init__(self, output_dir, keep_last=3, group=None):
        self.root = os.path.join(output_dir, "checkpoints")
        self.keep_last = int(keep_last)
        self.group = group

    def save(self, step, meta, backbone_state, trainer_state, head_arrays):
        """Write checkpoint `step`. `head_arrays` maps names to this rank's row arrays."""
        rank, world = get_rank(), get_world_size()
        final = os.path.join(self.root, f"step_{step:08d}")
        tmp = final + ".tmp"
        if rank == 0:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        barrier()
        head_dir = os.path.join(tmp, f"head_rank{rank}")
        os.makedirs(head_dir, exist_ok=True)
        for name, array in head_arrays.items():
            _save_npy(os.path.join(head_dir, f"{name}.npy"), np.asarray(array))
        _write_bytes(os.path.join(tmp, f"rng_rank{rank}.pkl"), pickle.dumps(capture_rng()))
        if rank == 0:
            _atomic_write(os.path.join(tmp, "backbone.pdparams"),
                          lambda p: paddle.save(backbone_state, p))
            _atomic_write(os.path.join(tmp, "trainer.pdstates"),
                          lambda p: paddle.save(trainer_state, p))
        barrier()
        if rank == 0:
            meta = dict(meta, step=step, world_size=world)
            _write_bytes(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1).encode())
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_bytes(os.path.join(self.root, "latest"), (os.path.basename(final) + "\n").encode())
            self._prune()
        barrier()
        return final

    def _prune(self):
        done = sorted(d for d in os.listdir(self.root) if _STEP_DIR.match(d))
        for old in done[:-self.keep_last]:
            shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)

    @staticmethod
    def load(path, rank, world_size):
        """(meta, backbone state, trainer state, rng state or None when the world size changed)."""
        meta = read_meta(path)
        backbone = paddle.load(os.path.join(path, "backbone.pdparams"))
        trainer = paddle.load(os.path.join(path, "trainer.pdstates"))
        rng = None
        rng_file = os.path.join(path, f"rng_rank{rank}.pkl")
        if meta["world_size"] == world_size and os.path.isfile(rng_file):
            with open(rng_file, "rb") as f:
                rng = pickle.load(f)
        return meta, backbone, trainer, rng


def _copy_checkpoint(src, dst, meta, head_rows):
    """Write checkpoint `dst` from `src`: same backbone and trainer state, the head
    arrays given by `head_rows(name, rank, start, count)` for `meta`'s partition."""
    if os.path.exists(dst):
        raise FileExistsError(f"{dst} exists; choose a new output folder")
    tmp = dst.rstrip("/") + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    for name in ("backbone.pdparams", "trainer.pdstates"):
        shutil.copy2(os.path.join(src, name), os.path.join(tmp, name))
    part = ClassPartition(meta["num_classes"], meta["world_size"])
    for r in range(part.world_size):
        os.makedirs(os.path.join(tmp, f"head_rank{r}"))
        for name in meta["head_arrays"]:
            rows = head_rows(name, r, part.class_start(r), part.num_local(r))
            _save_npy(os.path.join(tmp, f"head_rank{r}", f"{name}.npy"), rows)
    _write_bytes(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1).encode())
    os.replace(tmp, dst)
    return dst


def reshard_checkpoint(src, dst, world_size):
    """Copy checkpoint `src` to `dst` with the head split for `world_size` ranks.

    RNG states are per rank and are not carried over (the resumed run seeds anew).
    """
    meta = read_meta(src)
    part = ClassPartition(meta["num_classes"], world_size)  # raises for an impossible split
    meta = dict(meta, world_size=int(world_size), shard_size=part.shard_size)
    return _copy_checkpoint(src, dst, meta,
                            lambda name, r, start, count: load_head_rows(src, name, start, count))


def export_classifier(src, path, name="weight", chunk=1 << 16):
    """Write head array `name` of all classes as one `[C, ...]` .npy, streamed by chunks."""
    meta = read_meta(src)
    if name not in meta["head_arrays"]:
        raise KeyError(f"checkpoint {src} has no head array {name!r}; it has {meta['head_arrays']}")
    first = load_head_rows(src, name, 0, 1)
    tmp = path + ".part"
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=first.dtype,
                                    shape=(meta["num_classes"],) + first.shape[1:])
    for start in range(0, meta["num_classes"], chunk):
        count = min(chunk, meta["num_classes"] - start)
        out[start:start + count] = load_head_rows(src, name, start, count)
    out.flush()
    del out
    os.replace(tmp, path)
    return path


def import_classifier(src, dst, weight_path, bias_path=None):
    """Copy checkpoint `src` to `dst` with the classifier (and bias) read from .npy files of
    all classes. The optimizer state of the replaced arrays restarts from zero."""
    meta = read_meta(src)
    new = {"weight": np.load(weight_path, mmap_mode="r")}
    if bias_path is not None:
        new["bias"] = np.load(bias_path, mmap_mode="r")
    for name, array in new.items():
        if name not in meta["head_arrays"]:
            raise KeyError(f"checkpoint {src} has no head array {name!r}")
        expect = (meta["num_classes"],) + load_head_rows(src, name, 0, 1).shape[1:]
        if array.shape != expect:
            raise ValueError(f"{weight_path if name == 'weight' else bias_path} has shape "
                             f"{array.shape}, expected {expect} for checkpoint {src}")

    def rows(name, r, start, count):
        if name in new:
            return np.asarray(new[name][start:start + count])
        old = load_head_rows(src, name, start, count)
        replaced = any(name.startswith(f"opt.{n}.") for n in new)
        return np.zeros_like(old) if replaced else old

    return _copy_checkpoint(src, dst, meta, rows)


def save_best(output_dir, target, step, report, backbone_state):
    """Keep `<output_dir>/best_<target>/` = the backbone at its best step and `best.json`."""
    final = os.path.join(output_dir, f"best_{target}")
    tmp = final + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    paddle.save(backbone_state, os.path.join(tmp, "backbone.pdparams"))
    summary = {"target": target, "step": int(step),
               **{k: v for k, v in report.items() if k not in ("far", "tar")}}
    _write_bytes(os.path.join(tmp, "best.json"), json.dumps(summary, indent=1).encode())
    old = final + ".old"
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final
