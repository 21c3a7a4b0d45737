"""The trainer's checkpoints: the state it saves (checked finite on every rank first) and the
resume from one, on any world size."""
import time

import paddle

from .. import distributed as pd
from ..config import ConfigError
from ..dtypes import asked_as
from ..loading import check_meta, load_strict
from ..storage import all_rows_finite
from ..checkpoint import (CheckpointManager, CheckpointSaveError, array_dtype, head_array_bytes,
                          head_dtype, load_head_rows_into, local_optimizer_state,
                          portable_optimizer_state, restore_rng, training_meta)
from ..checkpoint.layout import is_centre_array, is_state_of, state_array

__all__ = ["Checkpointing"]


def _tensor_bytes(values):
    """Bytes of the Paddle tensors among `values`."""
    return sum(v.size * v.element_size() for v in values if isinstance(v, paddle.Tensor))


def _listed(groups):
    """"int8 (moment1, moment2), float32 (bias.velocity)" of {dtype: [state names]}."""
    return ", ".join(f"{d} ({', '.join(names)})" for d, names in groups.items())


def state_dtype_note(stored, run):
    """The log line of a resume whose head optimizer state is stored otherwise than this run
    stores it (`stored`, `run`: {head array name: storage dtype name}), or None:
    "head optimizer state: checkpoint has int8 (moment1, moment2), this run stores int4:
    converted on load". Dtypes are named as `Optimizer.head_state_dtype` names them (the 8- or
    4-bit map when both sides are of one width)."""
    old, new = {}, {}
    for name in sorted(stored):
        was, now = stored[name], run[name]
        state = is_state_of(name, "weight") or is_state_of(name, "bias")
        if not state or was == now:
            continue
        if asked_as(was) != asked_as(now):
            was, now = asked_as(was), asked_as(now)
        label = name.split(".", 2)[2] if is_state_of(name, "weight") else name.split(".", 1)[1]
        old.setdefault(was, []).append(label)
        new.setdefault(now, []).append(label)
    if not old:
        return None
    stores = next(iter(new)) if len(new) == 1 else _listed(new)
    return (f"head optimizer state: checkpoint has {_listed(old)}, this run stores {stores}: "
            "converted on load")


class Checkpointing:
    """`Trainer`'s saving and resuming: a mixin, on the trainer's backbone, head, optimizers,
    log and counters."""

    def _head_arrays(self):
        """This rank's class-indexed arrays as tensors (one row per class: with K sub-centres the
        weight and its state are viewed as `[num_local, K, d]`): the save streams them in slabs."""
        head = self.head
        arrays = {"weight": head.weight}
        if head.bias is not None:
            arrays["bias"] = head.bias
        for key, value in self.head_opt.state_dict().items():
            if key != "step_count":  # a scalar, kept in meta.json (`training_meta`)
                arrays[state_array(key)] = value
        k = head.sub_centers
        return {name: t.reshape([head.num_local, k, -1]) if k > 1 and is_centre_array(name) else t
                for name, t in arrays.items()}

    def _margin_state(self):
        """The margin's running values (AdaFace's norm statistics) as plain numbers."""
        margin = self.head.margin
        if not isinstance(margin, paddle.nn.Layer):
            return {}
        return {key: value.numpy().tolist() for key, value in margin.state_dict().items()}

    def _save_bytes(self):
        """About the bytes this rank writes in a checkpoint: its head arrays, and on rank 0 the
        backbone and its optimizer's state. Optimizer state not made yet (before the first
        step) counts as one copy of what it tracks per state array."""
        head = sum(head_array_bytes(a) for a in self._head_arrays().values())
        if not self.head_opt.state_dict():
            head *= 1 + len(self.head_opt.state_names)
        if self.rank != 0:
            return head
        params = _tensor_bytes(self.backbone.state_dict().values())
        state = _tensor_bytes(self.backbone_opt.state_dict().values())
        return head + params + (state or params)

    def _check_grace(self, probe=False):
        """At start (`probe`: measure the write rate first) and after a periodic save: warn
        once when a stop checkpoint would not fit `Checkpoint.grace_seconds`; a collective."""
        clock = self.save_clock
        if not clock.enabled:
            return
        clock.nbytes = self._save_bytes()
        if probe:
            clock.probe(self.ckpt.root)
        warning = clock.warning(self.world)
        if warning:
            self.log.warning(warning)

    def save(self):
        """Checkpoint this step (every rank); logs and returns its folder."""
        started = time.monotonic()
        pd.sync_buffers(self.backbone)  # the statistics saved are those every rank evaluates with
        head = self.head
        arrays = self._head_arrays()
        self._check_finite_weights(arrays)
        meta = training_meta(epoch=self.epoch, batch_in_epoch=self.batch_in_epoch,
                             num_classes=head.num_classes, embedding_size=head.embedding_size,
                             shard_size=head.partition.shard_size,
                             sample_step=int(head.sample_step), sub_centers=head.sub_centers,
                             margin_state=self._margin_state(), head_arrays=arrays,
                             model=self.cfg["Model"]["name"], config=self.cfg,
                             head_opt_step_count=int(self.head_opt.step_count))
        trainer_state = {"backbone_opt": portable_optimizer_state(self.backbone_opt.state_dict(),
                                                                  self.backbone),
                         "lr": self.lr.state_dict(), "scaler": self.scaler.state_dict(),
                         "nonfinite": self.nonfinite.state_dict()}
        self._saved_path = self._checked_save(
            self.ckpt.save, self.step, meta, self.backbone.state_dict(), trainer_state, arrays,
            {"data_skipped": [self.skipped_in_epoch, self.skipped_total]})
        self._saved_step = self.step
        seconds = time.monotonic() - started
        self.log.info(f"checkpoint of step {self.step} written: {self._saved_path} "
                      f"({seconds:.2f} s)")
        self.save_clock.nbytes = self._save_bytes()
        self.save_clock.measured(self.save_clock.nbytes, seconds, f"the save of step {self.step}")
        return self._saved_path

    def _check_finite_weights(self, head_arrays):
        """Raise `Diverged` on every rank, before anything is written, when a weight, a
        buffer or an optimizer state of any rank is not finite (an update overflowed)."""
        tensors = list(self.backbone.state_dict().values()) + list(head_arrays.values())
        bad = paddle.to_tensor([0.0 if all_rows_finite(tensors) else 1.0], dtype="float32")
        if self.world > 1:
            pd.all_reduce_(bad, "max")
        if bad.item():
            self._diverged(f"the weights or optimizer state after step {self.step} are not finite "
                           "(an update overflowed); checkpoint not written")

    def _checked_save(self, save, *args):
        """`save(*args)` on every rank; a failure is logged and raised (`CheckpointSaveError`:
        tools/train.py prints it and exits with status 74)."""
        try:
            return save(*args)
        except CheckpointSaveError as err:
            self.log.warning(str(err))
            self.log.close()
            raise

    def resume(self, path):
        meta, backbone_state, trainer_state, rng = CheckpointManager.load(path, self.rank, self.world)
        head = self.head
        # plsc's one loading rule (plsc.loading): the model name (unless the backbone was
        # given as a Layer), embedding size, image size and the head's shape must be the
        # config's; every backbone tensor must fit, or nothing is loaded.
        check_meta(path, meta, self.cfg, by_name=not self.backbone_given,
                   more=[("Loss.num_classes", meta.get("num_classes"), head.num_classes),
                         ("Loss.sub_centers", meta.get("sub_centers", 1), head.sub_centers)])
        load_strict(self.backbone, backbone_state, path)
        self.backbone_opt.set_state_dict(local_optimizer_state(trainer_state["backbone_opt"],
                                                               self.backbone))
        self.lr.set_state_dict(trainer_state["lr"])
        self.lr.last_lr = self.lr.get_lr()  # a function of the step (a converted checkpoint has no rate)
        if "scaler" in trainer_state:  # (a converted checkpoint has none: the scaler starts fresh)
            self.scaler.set_state_dict(trainer_state["scaler"])
        self.nonfinite.set_state_dict(trainer_state.get("nonfinite", {}))
        self._resume_head(path, meta)
        head.sample_step.set_value(paddle.to_tensor(meta["sample_step"], dtype="int64"))
        margin = head.margin
        state = margin.state_dict() if isinstance(margin, paddle.nn.Layer) else {}
        for key, value in meta.get("margin_state", {}).items():
            if key in state:  # a run may go on with another margin
                state[key].set_value(paddle.to_tensor(value, dtype="float32"))
        self.step, self.epoch = meta["step"], meta["epoch"]
        self.batch_in_epoch = meta["batch_in_epoch"]
        if rng is not None:  # this rank's RNG and skip counts (not kept across world sizes)
            restore_rng(rng)
            self.skipped_in_epoch, self.skipped_total = rng.get("data_skipped", (0, 0))
        self.log.info(f"resumed from {path} at step {self.step} (written by {meta['world_size']} "
                      f"rank(s), now {self.world})")

    def _resume_head(self, path, meta):
        """Fill this rank's head arrays and their optimizer state in place from checkpoint
        `path`, in their dtypes (each converted slab by slab), on any world size."""
        self.head_opt.init_state(self.head)  # zero state tensors to fill, in their dtypes
        arrays = self._head_arrays()
        stored = set(meta["head_arrays"])
        missing = (set(arrays) - stored) & {"weight", "bias"}
        unknown = stored - set(arrays)
        if missing or unknown:
            raise ConfigError(f"checkpoint {path} has head arrays {sorted(stored)}; this run's head "
                              f"and {type(self.head_opt).__name__} keep {sorted(arrays)}")
        for name in sorted(stored):  # optimizer state the checkpoint lacks stays zero
            load_head_rows_into(path, name, self.head.class_start, arrays[name], meta)
        note = state_dtype_note({n: head_dtype(path, n, meta) for n in stored},
                                {n: array_dtype(arrays[n]) for n in stored})
        if note:
            self.log.info(note)
        if "head_opt_step_count" in meta:
            self.head_opt.set_state_dict({"step_count": meta["head_opt_step_count"]})
