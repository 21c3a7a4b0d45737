"""The names in a checkpoint folder and the keys of its `meta.json`: the one place they are
spelled.

    <output_dir>/checkpoints/step_00001234/
        backbone.pdparams          backbone weights and buffers (rank 0)
        trainer.pdstates           backbone optimizer + LR schedule + loss scaler (rank 0)
        rng_rank{r}.pkl            rank r's Python, NumPy and Paddle RNG states, and its
                                   count of skipped bad samples (Data.skip_bad)
        head_rank{r}/<name>.npy    rank r's rows of every class-indexed array
        meta.json                  step, epoch, partition, world size, ... (rank 0)
        manifest.json              size and CRC-32 of every file above (rank 0, written last)
    <output_dir>/checkpoints/latest    the newest step folder's name
    <output_dir>/best_<target>/        backbone.pdparams + best.json of a target's best step
    <output_dir>/.plsc.lock            the lock of the job using the folder, and who holds it

Head array names: `weight`, `bias`, and `opt.<param>.<state>` for their optimizer state
(e.g. `opt.weight.velocity`). With K sub-centres the weight and its state are stored
`[classes, K, ...]`.
"""
import json
import os
import re

from ..fileio import write_json
from .errors import CheckpointDamaged, read_json

__all__ = ["META", "BACKBONE", "TRAINER", "LATEST", "BEST_SUMMARY", "LOCK_FILE", "STEP_DIR", "LEFTOVER_DIR",
           "step_folder", "best_folder", "rng_file", "head_dir", "head_file", "state_array", "is_state_of",
           "is_centre_array", "read_meta", "write_meta", "training_meta", "with_written"]

META = "meta.json"
BACKBONE = "backbone.pdparams"
TRAINER = "trainer.pdstates"
LATEST = "latest"
BEST_SUMMARY = "best.json"
LOCK_FILE = ".plsc.lock"  # in the output folder (`plsc.checkpoint.lock`)
STEP_DIR = re.compile(r"^step_(\d{8})$")
LEFTOVER_DIR = re.compile(r"^(step_\d{8}|best_.+)\.(tmp|old)$")
_STATE_PREFIX = "opt."


def step_folder(root, step):
    """`<root>/step_XXXXXXXX`."""
    return os.path.join(root, f"step_{int(step):08d}")


def best_folder(output_dir, target):
    """`<output_dir>/best_<target>`."""
    return os.path.join(output_dir, f"best_{target}")


def rng_file(rank):
    return f"rng_rank{rank}.pkl"


def head_dir(rank):
    return f"head_rank{rank}"


def head_file(rank, name):
    """Path of head array `name` of rank `rank`, relative to the checkpoint folder."""
    return f"{head_dir(rank)}/{name}.npy"


def state_array(key):
    """The head array name of optimizer state `key` (e.g. "weight.velocity")."""
    return _STATE_PREFIX + key


def is_state_of(name, param):
    """Whether head array `name` is optimizer state of parameter `param` ("weight", "bias")."""
    return name.startswith(f"{_STATE_PREFIX}{param}.")


def is_centre_array(name):
    """Whether head array `name` has a row per class centre (the weight and its state)."""
    return name == "weight" or is_state_of(name, "weight")


def read_meta(path):
    """The meta.json of checkpoint folder `path`; `CheckpointDamaged` when it does not parse."""
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint: {meta_path} is missing")
    meta = read_json(meta_path)
    if not isinstance(meta, dict):
        raise CheckpointDamaged(meta_path, f"expected a JSON object, found {type(meta).__name__}")
    return meta


def write_meta(folder, meta):
    """Write `folder/meta.json`; its `FileRecord`."""
    return write_json(os.path.join(folder, META), meta)


def training_meta(*, epoch, batch_in_epoch, num_classes, embedding_size, shard_size,
                  sample_step, sub_centers, margin_state, head_arrays, model, config,
                  head_opt_step_count):
    """A training run's meta.json keys, before the save adds `step`, `world_size`,
    `head_dtypes` and `manifest` (`with_written`). `head_opt_step_count`: the steps the head
    optimizer applied (its 16-bit rounding draws bits from it, so a resumed run continues the
    uninterrupted run's sequence)."""
    return {"epoch": epoch, "batch_in_epoch": batch_in_epoch, "num_classes": num_classes,
            "embedding_size": embedding_size, "shard_size": shard_size,
            "sample_step": sample_step, "sub_centers": sub_centers,
            "margin_state": margin_state, "head_arrays": sorted(head_arrays), "model": model,
            "config": json.loads(json.dumps(config)), "head_opt_step_count": head_opt_step_count}


def with_written(meta, *, step, world_size, head_dtypes):
    """`meta` with what a save knows: the step, the world size, each head array's dtype and
    that the folder has a manifest."""
    return dict(meta, step=step, world_size=world_size, manifest=True,
                head_dtypes=dict(sorted(head_dtypes.items())))
