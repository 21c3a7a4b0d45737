"""Saving and finding checkpoints so that they survive a kill in the middle of a save, a full
disk, damaged files and a change of world size. The folder's layout and meta.json keys are
`plsc.checkpoint.layout`'s; the head arrays `head_arrays`'; the manifest and its checks
`manifest`'s. Every file goes through `plsc.fileio`'s atomic writer.

A save: the ranks add up the bytes they are about to write and stop, all of them, when the
disk cannot hold them; every rank writes into `step_XXXXXXXX.tmp`; the ranks exchange their
files' sizes and checksums (and any error); rank 0 writes meta.json and the manifest, renames
the folder and rewrites `latest`. A failure on any rank makes every rank raise the same
`CheckpointSaveError` (one line: what failed, free space against the checkpoint's size, the
previous checkpoint) and the temporary folder is removed; `tools/train.py` exits with
`IO_ERROR_EXIT_CODE`. A folder without meta.json or ending in `.tmp` is never loaded;
`remove_leftovers` deletes those of a crashed run.

A resume (`agree_checkpoint`) verifies the checkpoint against its manifest
(`Checkpoint.verify`); under `auto`/`latest` a damaged newest checkpoint is reported and the
ranks fall back together to the newest intact one.
"""
import contextlib
import json
import os
import pickle
import random
import shutil

import numpy as np
import paddle

from .. import distributed as pd
from ..fileio import (FOLDER_SUFFIX, AtomicWriter, FileRecord, atomic_write, commit_folder, free_bytes, is_temporary,
                      temp_folder, write_json)
from .errors import CheckpointDamaged, CheckpointSaveError
from .head_arrays import array_dtype, head_array_bytes, write_rows_npy
from .layout import (BACKBONE, BEST_SUMMARY, LATEST, LEFTOVER_DIR, META, STEP_DIR, TRAINER,
                     best_folder, head_dir, head_file, read_meta, rng_file, step_folder, with_written,
                     write_meta)
from .manifest import verify_checkpoint, write_manifest
from .paddle_file import paddle_file_bytes, write_paddle_file

__all__ = ["CheckpointManager", "find_checkpoint", "agree_checkpoint", "checkpoints_newest_first",
           "remove_leftovers", "repair_latest", "capture_rng", "restore_rng", "portable_optimizer_state",
           "local_optimizer_state", "save_best", "load_paddle_file"]


def _human(n):
    """Bytes as '1.5 GB'."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def _exchange(obj, group=None):
    """Every rank's JSON-able `obj`, in rank order, on every rank (two all-reduces)."""
    rank, world = pd.group_rank_size(group)
    if world == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    length = pd.all_reduce_(paddle.to_tensor([float(data.size)], dtype="float32"), "max", group)
    buf = np.zeros((world, int(length.item())), np.float32)
    buf[rank, :data.size] = data
    rows = pd.all_reduce_(paddle.to_tensor(buf), "sum", group).numpy().astype(np.uint8)
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in rows]


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


def checkpoints_newest_first(output_dir):
    """The complete checkpoint folders (with their meta.json) under `output_dir`, newest first."""
    root = os.path.join(output_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else ()
    return [os.path.join(root, d) for d in sorted(names, reverse=True)
            if STEP_DIR.match(d) and os.path.isfile(os.path.join(root, d, META))]


def _none_found(path, output_dir):
    if path == "auto":
        return None
    raise FileNotFoundError(f"Global.checkpoint=latest but {os.path.join(output_dir, 'checkpoints')} "
                            "holds no complete checkpoint")


def find_checkpoint(path, output_dir, verify="none", warn=None, only=None):
    """Resolve a Global.checkpoint value in this process: 'latest' (the newest complete
    checkpoint under output_dir; an error if there is none), 'auto' (the same, or None when
    there is none: start fresh) or a checkpoint folder (checked).

    `verify` ("full", "size", "none"): under auto/latest a damaged checkpoint is passed to
    `warn(message)` and the next older one tried; an explicit folder raises `CheckpointDamaged`.
    `only`: verify only these files of it (e.g. ("backbone.pdparams",))."""
    if path not in ("latest", "auto"):
        read_meta(path)
        verify_checkpoint(path, verify, only=only)
        return path
    found = checkpoints_newest_first(output_dir)
    damaged = []
    for candidate in found:
        try:
            verify_checkpoint(candidate, verify, only=only)
            return candidate
        except CheckpointDamaged as err:
            damaged.append(err)
            if warn is not None:
                warn(_fallback_message(err, candidate, found))
    if damaged:
        raise _all_damaged(output_dir, damaged[0])
    return _none_found(path, output_dir)


def _fallback_message(err, candidate, found):
    older = found[found.index(candidate) + 1:]
    then = f"trying {os.path.basename(older[0])}" if older else "no older checkpoint left"
    return f"checkpoint {os.path.basename(candidate)} is damaged and is skipped: {err}; {then}"


def _all_damaged(output_dir, first):
    return CheckpointDamaged(first.file, f"{first.reason}; no intact checkpoint "
                             f"is left under {os.path.join(output_dir, 'checkpoints')}")


def agree_checkpoint(path, output_dir, verify="full", warn=None, group=None):
    """`find_checkpoint` for all ranks together: the ranks split the verification reads, learn
    of damage found by any of them and pick the same checkpoint (rank 0's listing decides the
    candidates). `warn(message)` is called on rank 0."""
    rank, world = pd.group_rank_size(group)
    explicit = path not in ("latest", "auto")
    if explicit:
        read_meta(path)
        found = [path]
    else:
        found = _exchange(checkpoints_newest_first(output_dir) if rank == 0 else None, group)[0]
    first = None
    for candidate in found:
        try:
            verify_checkpoint(candidate, verify, share=(rank, world))
            mine = None
        except CheckpointDamaged as err:
            mine = [err.file, err.reason]
        reports = [r for r in _exchange(mine, group) if r]
        if not reports:
            return candidate
        err = CheckpointDamaged(*reports[0])
        if explicit:
            raise err
        first = first or err
        if warn is not None and rank == 0:
            warn(_fallback_message(err, candidate, found))
    if first is not None:
        raise _all_damaged(output_dir, first)
    return _none_found(path, output_dir)


def remove_leftovers(output_dir):
    """Delete what a crashed save leaves: `checkpoints/step_*.tmp` folders, the atomic writer's
    temporary files there and in `output_dir`, and `best_*.tmp`/`best_*.old` folders. Call it
    on one rank before any save; returns the names removed."""
    removed = []
    for folder in (output_dir, os.path.join(output_dir, "checkpoints")):
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            full = os.path.join(folder, name)
            if os.path.isdir(full) and LEFTOVER_DIR.match(name):
                shutil.rmtree(full, ignore_errors=True)
            elif os.path.isfile(full) and is_temporary(name):
                os.remove(full)
            else:
                continue
            removed.append(os.path.relpath(full, output_dir))
    return removed


def repair_latest(output_dir):
    """Make `checkpoints/latest` name the newest complete checkpoint: the newest folder whose
    files all have their manifest's sizes (`verify_checkpoint(..., "size")`, a `stat` per
    file). A kill between a save's rename and its rewrite of `latest` leaves it naming the
    previous one. Call it on one rank at start, under the folder's lock (`plsc.checkpoint.lock`);
    returns a line for the log when `latest` changed, else None."""
    file = os.path.join(output_dir, "checkpoints", LATEST)
    try:
        with open(file, "rb") as f:
            named = f.read(4096).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        named = None
    newest = None
    for path in checkpoints_newest_first(output_dir):
        try:
            verify_checkpoint(path, "size")
        except (CheckpointDamaged, OSError):
            continue
        newest = os.path.basename(path)
        break
    if named == newest:
        return None
    if newest is None:
        os.remove(file)
        return f"removed {file}: it named {named!r} and no complete checkpoint is left"
    atomic_write(file, newest + "\n")
    was = f"named {named!r}" if named is not None else "was missing"
    return f"{file} {was}; it now names {newest}, the newest complete checkpoint"


def load_paddle_file(file):
    """`paddle.load(file)` with a `CheckpointDamaged` naming the file when it does not parse."""
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} is missing")
    try:
        return paddle.load(file)
    except (ValueError, EOFError, pickle.UnpicklingError, RuntimeError, KeyError) as err:
        raise CheckpointDamaged(file, f"paddle.load cannot read it ({str(err)[:200]})") from None


def _previous(root, step):
    """Which checkpoint a resume would use instead of `step` (the newest other one whose
    files have their manifest's sizes), for messages."""
    for path in checkpoints_newest_first(os.path.dirname(root)):
        if os.path.basename(path) == os.path.basename(step_folder(root, step)):
            continue
        try:
            verify_checkpoint(path, "size")
        except (CheckpointDamaged, OSError):
            continue
        return f"the previous checkpoint (step {int(path[-8:])}, {path}) is intact"
    return "there is no intact previous checkpoint"


class _Save:
    """What a rank reports to the others after a part of a save: its error, if any."""

    def __init__(self, root, label, previous, group):
        self.root, self.label, self.previous, self.group = root, label, previous, group
        self.need = 0
        self.error = self.original = None

    @contextlib.contextmanager
    def part(self):
        """Run a part of the save, keeping an error to report instead of raising it."""
        try:
            yield
        except OSError as err:
            where = f" {err.filename}" if err.filename else ""
            self.error = {"what": f"could not write{where}: {err.strerror or err}",
                          "free": free_bytes(self.root)}
        except Exception as err:  # a bug, not the disk: this rank re-raises it
            self.original = err
            self.error = {"what": f"failed: {type(err).__name__}: {err}",
                          "free": free_bytes(self.root)}

    def agree(self, tmp, extra=None):
        """Exchange errors (and `extra`); raise the same failure on every rank if any; the
        other ranks' `extra`."""
        rank, _ = pd.group_rank_size(self.group)
        reports = _exchange({"error": self.error, "extra": extra}, self.group)
        failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
        if not failed:
            return [rep["extra"] for rep in reports]
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if self.original is not None:
            raise self.original
        who, error = failed[0]
        raise CheckpointSaveError(
            f"{self.label} not written: rank {who} {error['what']} ({_human(error['free'])} "
            f"free, it needs {_human(self.need)}); {self.previous()}; the partial folder was "
            "removed")


class CheckpointManager:
    """Saves and restores the whole training state; keeps the last `keep_last`."""

    def __init__(self, output_dir, keep_last=3, group=None):
        self.root = os.path.join(output_dir, "checkpoints")
        self.keep_last = int(keep_last)
        self.group = group

    def save(self, step, meta, backbone_state, trainer_state, head_arrays, rank_state=None):
        """Write checkpoint `step` (all ranks). `head_arrays` maps names to this rank's row
        arrays (Paddle tensors, written a slab of rows at a time, or numpy arrays); meta.json
        gets their dtypes as `head_dtypes`. `rank_state` (picklable values of this rank) is
        kept beside its RNG states and returned by `load` with them. Raises `CheckpointSaveError` on every rank when
        any rank fails."""
        rank, world = pd.group_rank_size(self.group)
        final = step_folder(self.root, step)
        tmp = final + FOLDER_SUFFIX
        state = _Save(self.root, f"checkpoint step {step}", lambda: _previous(self.root, step),
                      self.group)
        files = {rng_file(rank): pickle.dumps(dict(capture_rng(), **(rank_state or {})))}
        states = {BACKBONE: backbone_state, TRAINER: trainer_state} if rank == 0 else {}
        need = sum(len(b) for b in files.values()) + sum(map(paddle_file_bytes, states.values())) + sum(
            head_array_bytes(a) + 128 for a in head_arrays.values()) + (64 << 10)  # + meta
        with state.part():
            if rank == 0:
                temp_folder(final)
        infos = state.agree(tmp, {"need": need, "free": free_bytes(self.root)})
        state.need = sum(i["need"] for i in infos)
        free = infos[0]["free"]
        if not _fits(state.need, free):  # the same decision on every rank: rank 0's free space
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointSaveError(
                f"checkpoint step {step} not written: it needs {_human(state.need)} but "
                f"{self.root} has {_human(free)} free; {_previous(self.root, step)}")
        records = {}
        with state.part():
            os.makedirs(os.path.join(tmp, head_dir(rank)), exist_ok=True)
            for name, array in head_arrays.items():  # Paddle tensors are streamed, not copied
                records[head_file(rank, name)] = write_rows_npy(
                    os.path.join(tmp, head_file(rank, name)), array)[1]
            for name, data in files.items():
                records[name] = atomic_write(os.path.join(tmp, name), data)
            for name, value in states.items():  # streamed: no serialised copy in memory
                records[name] = _write_state(os.path.join(tmp, name), value)
        ranks_records = state.agree(tmp, {k: list(v) for k, v in records.items()})
        with state.part():
            if rank == 0:
                self._finish(tmp, final, step, meta, head_arrays, world, ranks_records)
        state.agree(tmp)
        return final

    def _finish(self, tmp, final, step, meta, head_arrays, world, ranks_records):
        """Rank 0: meta.json, the manifest (last), the rename, `latest`, pruning."""
        records = {name: tuple(r) for part in ranks_records for name, r in part.items()}
        meta = with_written(meta, step=step, world_size=world,
                            head_dtypes={n: array_dtype(a) for n, a in head_arrays.items()})
        records[META] = write_meta(tmp, meta)
        write_manifest(tmp, {k: _record(v) for k, v in records.items()})
        commit_folder(tmp, final)
        try:
            atomic_write(os.path.join(self.root, LATEST), os.path.basename(final) + "\n")
        except OSError:
            shutil.rmtree(final, ignore_errors=True)  # as if the save never happened
            raise
        self._prune()

    def _prune(self):
        done = sorted(d for d in os.listdir(self.root) if STEP_DIR.match(d))
        for old in done[:-self.keep_last]:
            shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)

    @staticmethod
    def load(path, rank, world_size):
        """(meta, backbone state, trainer state, rng state or None when the world size changed).
        A damaged file raises `CheckpointDamaged` naming it (whatever `Checkpoint.verify`)."""
        meta = read_meta(path)
        backbone = load_paddle_file(os.path.join(path, BACKBONE))
        trainer = load_paddle_file(os.path.join(path, TRAINER))
        rng = None
        rng_path = os.path.join(path, rng_file(rank))
        if meta["world_size"] == world_size and os.path.isfile(rng_path):
            try:
                with open(rng_path, "rb") as f:
                    rng = pickle.load(f)
            except (pickle.UnpicklingError, EOFError, ValueError) as err:
                raise CheckpointDamaged(rng_path, f"not a pickle ({err})") from None
        return meta, backbone, trainer, rng


def _fits(need, free):
    """Whether `need` bytes may be written where `free` are free."""
    return need <= free


def _record(value):
    return FileRecord(int(value[0]), str(value[1]))


def _write_state(path, state):
    """`state` in `paddle.save`'s format at `path`, streamed through the atomic writer (which
    checksums the bytes as they pass); its `FileRecord`."""
    with AtomicWriter(path) as f:
        write_paddle_file(f, state)
    return f.record


def save_best(output_dir, target, step, report, backbone_state, group=None):
    """Keep `<output_dir>/best_<target>/` = the backbone at its best step and `best.json`.
    Called on every rank (rank 0 writes); a failure raises `CheckpointSaveError` on all."""
    rank, _ = pd.group_rank_size(group)
    final = best_folder(output_dir, target)
    tmp = final + FOLDER_SUFFIX
    state = _Save(output_dir, f"best_{target} (step {step})",
                  lambda: f"the previous best_{target} is kept", group)
    with state.part():
        if rank == 0:
            state.need = paddle_file_bytes(backbone_state) + 4096
            if state.need > free_bytes(output_dir):
                raise OSError(28, "not enough free space (checked before writing)", final)
            temp_folder(final)
            _write_state(os.path.join(tmp, BACKBONE), backbone_state)
            summary = {"target": target, "step": int(step),
                       **{k: v for k, v in report.items() if k not in ("far", "tar")}}
            write_json(os.path.join(tmp, BEST_SUMMARY), summary)
            commit_folder(tmp, final)
    state.agree(tmp)
    return final
