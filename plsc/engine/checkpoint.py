"""Checkpoints that survive a kill in the middle of a save and a change of world size.

Layout of `<output_dir>/checkpoints/step_00001234/`:

    meta.json                  step, epoch, partition, world size, ... (written last)
    backbone.pdparams          backbone weights and buffers (rank 0)
    trainer.pdstates           backbone optimizer + LR schedule + loss scaler (rank 0)
    rng_rank{r}.pkl            Python, NumPy and Paddle RNG states of rank r
    head_rank{r}/<name>.npy    rank r's rows of every class-indexed array: the
                               weight, the bias and their optimizer state

The head arrays, their dtypes (meta.json `head_dtypes`), streamed saves and loads, re-sharding
and export are `plsc.engine.head_store`'s. A head optimizer's scalar state is in meta.json
(`head_opt_step_count`).

Every rank writes into `step_XXXXXXXX.tmp`; after a barrier rank 0 renames the folder and
rewrites `latest`; a folder without `meta.json` or ending in `.tmp` is never loaded.
"""
import json
import os
import pickle
import random
import re
import shutil

import numpy as np
import paddle

from ..distributed import barrier, get_rank, get_world_size
from .head_store import (array_dtype, atomic_write, export_classifier, head_dtype,  # noqa: F401
                         import_classifier, load_head_rows, load_head_rows_into, read_meta,
                         reshard_checkpoint, save_rows_npy, write_bytes)

__all__ = ["CheckpointManager", "find_checkpoint", "read_meta", "load_head_rows", "capture_rng",
           "restore_rng", "portable_optimizer_state", "local_optimizer_state", "reshard_checkpoint",
           "export_classifier", "import_classifier", "save_best", "save_rows_npy",
           "load_head_rows_into", "head_dtype"]

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


def find_checkpoint(path, output_dir):
    """Resolve a Global.checkpoint value: 'latest' (the newest complete checkpoint under
    output_dir; an error if there is none), 'auto' (the same, or None when there is none:
    start fresh) or a checkpoint folder (checked)."""
    if path in ("latest", "auto"):
        root = os.path.join(output_dir, "checkpoints")
        done = sorted(d for d in (os.listdir(root) if os.path.isdir(root) else ())
                      if _STEP_DIR.match(d) and os.path.isfile(os.path.join(root, d, "meta.json")))
        if not done:
            if path == "auto":
                return None
            raise FileNotFoundError(f"Global.checkpoint=latest but {root} holds no complete checkpoint")
        return os.path.join(root, done[-1])
    read_meta(path)
    return path


class CheckpointManager:
    """Saves and restores the whole training state; keeps the last `keep_last`."""

    def __init__(self, output_dir, keep_last=3, group=None):
        self.root = os.path.join(output_dir, "checkpoints")
        self.keep_last = int(keep_last)
        self.group = group

    def save(self, step, meta, backbone_state, trainer_state, head_arrays):
        """Write checkpoint `step`. `head_arrays` maps names to this rank's row arrays
        (Paddle tensors, written a slab of rows at a time, or numpy arrays); meta.json gets
        their dtypes as `head_dtypes`."""
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
        for name, array in head_arrays.items():  # Paddle tensors are streamed, not copied whole
            save_rows_npy(os.path.join(head_dir, f"{name}.npy"), array)
        write_bytes(os.path.join(tmp, f"rng_rank{rank}.pkl"), pickle.dumps(capture_rng()))
        if rank == 0:
            atomic_write(os.path.join(tmp, "backbone.pdparams"),
                          lambda p: paddle.save(backbone_state, p))
            atomic_write(os.path.join(tmp, "trainer.pdstates"),
                          lambda p: paddle.save(trainer_state, p))
        barrier()
        if rank == 0:
            meta = dict(meta, step=step, world_size=world,
                        head_dtypes={n: array_dtype(a) for n, a in sorted(head_arrays.items())})
            write_bytes(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1).encode())
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_bytes(os.path.join(self.root, "latest"), (os.path.basename(final) + "\n").encode())
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
    write_bytes(os.path.join(tmp, "best.json"), json.dumps(summary, indent=1).encode())
    old = final + ".old"
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final
