"""The training loop: data-parallel backbone, model-parallel head."""
import contextlib
import functools
import os

import numpy as np
import paddle

from .. import distributed as pd
from .. import cpu_setup, runtime, startup
from ..config import ConfigError, dump_config
from ..cpu_kernels import finite_flag
from ..data import DataError, DataLoader, DistributedBatchSampler, Prefetcher
from ..data.tensors import to_tensor
from ..nn import PartialFC
from ..storage import all_rows_finite
from ..optim.schedule import StepLR, make_lr_fn
from ..checkpoint import (CheckpointManager, CheckpointSaveError, agree_checkpoint, find_checkpoint,
                          load_head_rows_into, local_optimizer_state, portable_optimizer_state,
                          remove_leftovers, repair_latest, restore_rng, save_best, training_meta)
from ..checkpoint.layout import is_centre_array, state_array
from ..checkpoint.lock import claim_folder
from ..data import PeerDataError
from ..embedding import VerificationEvaluator
from ..fileio import atomic_write
from .amp import LossScaler
from .builders import (build_backbone_optimizer, build_head_optimizer, build_margin_from_config,
                       build_train_dataset)
from .divergence import Diverged, NonFiniteSteps
from .grad_sync import OverlappedSum
from .logger import TrainLogger, visualdl_dir
from .preemption import Preempted, RankLost, StopSignals, host_group, peer_failure

__all__ = ["Trainer"]


class _FromBatch:
    """A batch sampler that starts its epoch at batch `start` (resume mid-epoch)."""

    def __init__(self, sampler, start=0):
        self.sampler, self.start = sampler, start

    def __len__(self):
        return len(self.sampler) - self.start

    def __iter__(self):
        for i, batch in enumerate(self.sampler):
            if i >= self.start:
                yield batch


def _closed_on_error(init):
    """An `__init__` that releases what it took (the output folder's lock) when it raises."""
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except BaseException:
            self.close()
            raise
    return wrapper


def _reports_lost_ranks(init):
    """`Trainer.__init__` (start-up: process group, checkpoint agreement, every collective
    before the first step) with a rank that stops answering reported as in training:
    `RankLost`, one line, exit status 69."""
    @functools.wraps(init)
    def start(self, *args, **kwargs):
        with self._rank_failures(starting=True):
            init(self, *args, **kwargs)
    return start


class Trainer:
    """Builds everything a config describes and trains it.

    `backbone` may be given as a `paddle.nn.Layer` instead of `Model.name`.
    The output folder is locked from the start (`plsc.checkpoint.lock`) until `train()`
    returns or raises, `close()`, or the end of the object.
    """

    @_reports_lost_ranks
    @_closed_on_error
    def __init__(self, cfg, backbone=None):
        self.cfg = cfg
        g, d, o = cfg["Global"], cfg["Data"], cfg["Optimizer"]
        self.device = runtime.start(cfg)
        self.rank, self.world = pd.get_rank(), pd.get_world_size()
        self.output_dir = g["output_dir"]
        self._folder = self._claim()  # before anything touches the folder
        amp = cfg["AMP"]
        if amp["enable"] and not self.device.startswith("gpu"):
            raise ConfigError("AMP.enable is true but training runs on the CPU; AMP needs a GPU")
        paddle.seed(g["seed"])
        np.random.seed(g["seed"])
        self.accumulate = o["accumulate_steps"]
        self.dataset = build_train_dataset(cfg)
        dropped = list(getattr(self.dataset, "skipped", []))  # entries left out while indexing
        if len(dropped) > d["skip_bad"]:
            raise DataError(f"{dropped[-1]}; {len(dropped)} bad entries, more than Data.skip_bad="
                            f"{d['skip_bad']}")
        self.sampler = DistributedBatchSampler(self.dataset, d["batch_size"], self.rank, self.world,
                                               shuffle=True, seed=g["seed"], drop_last=True,
                                               block_size=d["block_shuffle"],
                                               buffer_blocks=d["shuffle_buffer"])
        self.steps_per_epoch = len(self.sampler) // self.accumulate
        if self.steps_per_epoch < 1:
            raise ConfigError(f"Data.batch_size {d['batch_size']} x {self.world} ranks x "
                              f"{self.accumulate} accumulation steps exceeds the {len(self.dataset)} "
                              "training images")
        self.total_steps = g["max_steps"] or g["epochs"] * self.steps_per_epoch
        self.global_batch = d["batch_size"] * self.world * self.accumulate

        m = cfg["Model"]
        self.backbone = backbone if backbone is not None else runtime.build_backbone(cfg)
        if g["pretrained"]:
            runtime.load_pretrained(self.backbone, g["pretrained"])  # .pdparams or arcface_torch's .pt
        loss = cfg["Loss"]
        paddle.seed(g["seed"] + 1 + self.rank)  # class centres differ from rank to rank
        self.head = PartialFC(m["embedding_size"], loss["num_classes"], build_margin_from_config(loss),
                              sample_ratio=loss["sample_ratio"], seed=g["seed"],
                              chunk_size="auto" if loss["chunk_size"] is None else loss["chunk_size"],
                              logits_budget=int(loss["logits_budget_mb"] * (1 << 20)),
                              param_dtype=loss["param_dtype"], sub_centers=loss["sub_centers"],
                              interclass_filtering_threshold=loss["interclass_filtering_threshold"],
                              check_inputs="labels")  # the sampler makes equal batches
        paddle.seed(g["seed"] + 7919 * (self.rank + 1))  # dropout etc. per rank

        self.lr = StepLR(self._lr_fn())
        self.backbone_opt = build_backbone_optimizer(cfg, self.backbone.parameters(), self.lr)
        # The backbone's gradients are summed across ranks while the backward goes on.
        self.gradient_sum = OverlappedSum(self.backbone.parameters())
        self.head_opt = build_head_optimizer(cfg, self.lr)
        self.scaler = LossScaler(amp["enable"] and amp["dtype"] == "float16", amp["init_loss_scaling"])
        self.nonfinite = NonFiniteSteps(g["max_nonfinite_steps"])
        self.ckpt = CheckpointManager(self.output_dir, cfg["Checkpoint"]["keep_last"])
        e = cfg["Eval"]
        self.evaluator = (VerificationEvaluator(e["root"], e["targets"], d["image_size"],
                                                e["batch_size"]) if e["targets"] else None)
        lg = cfg["Logging"]
        self.log = TrainLogger(self.output_dir, self.total_steps, g["log_interval"],
                               enabled=self.rank == 0, visualdl=lg["visualdl"],
                               progress_bar=lg["progress_bar"])
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.skipped_in_epoch = self.skipped_total = 0  # bad samples replaced on this rank
        self._pending_skips = 0  # ... in batches loaded for a step not taken yet
        self.history = []  # (step, loss) of every optimizer step of this process
        self.step_losses = []  # the last step's micro-batch losses (`optimizer_step`)
        self.eval_history = []
        self.best = {}  # target -> best accuracy so far
        self._saved_step = self._saved_path = None  # the last checkpoint this process wrote
        if self.rank == 0:  # what a crashed save left behind
            removed = remove_leftovers(self.output_dir)
            if removed:
                self.log.info(f"removed {len(removed)} leftover(s) of an interrupted save under "
                              f"{self.output_dir}: {', '.join(removed)}")
            for note in self._folder.notes:  # the lock's limits on this file system
                self.log.warning(note)
            repaired = repair_latest(self.output_dir)  # a save killed before rewriting `latest`
            if repaired:
                self.log.info(repaired)
        if g["checkpoint"]:
            path = agree_checkpoint(g["checkpoint"], self.output_dir,
                                    cfg["Checkpoint"]["verify"], warn=self.log.warning)
            if path is None:  # Global.checkpoint=auto and nothing to resume
                self.log.info(f"Global.checkpoint=auto: no checkpoint under "
                              f"{os.path.join(self.output_dir, 'checkpoints')}; starting fresh")
            else:
                if g["checkpoint"] == "auto":
                    self.log.info(f"Global.checkpoint=auto: resuming from {path}")
                self.resume(path)
        if self.rank == 0:
            os.makedirs(self.output_dir, exist_ok=True)
            atomic_write(os.path.join(self.output_dir, "config.yaml"), dump_config(cfg))

    def _claim(self):
        """Rank 0 locks the output folder and checks that it and the VisualDL folder can be
        written; otherwise every rank raises `FolderInUse` (73) or `FolderNotWritable` (74)."""
        vdl = visualdl_dir(self.output_dir)
        return claim_folder(self.output_dir, [("the VisualDL log folder", vdl)]
                            if self.cfg["Logging"]["visualdl"] else [])

    def close(self):
        """Release the output folder's lock and close the VisualDL writer; idempotent."""
        folder, self._folder = getattr(self, "_folder", None), None
        if folder is not None:
            folder.release()
        if getattr(self, "log", None) is not None:
            self.log.close()

    @property
    def fused_head_update(self):
        """Whether the head's rows are updated inside its backward: only where that equals the
        separate update, i.e. the step is applied whatever comes later (no accumulation, no
        float16 loss-scale check that may skip it)."""
        return (self.cfg["Optimizer"]["fused_head_update"] and self.accumulate == 1
                and not self.scaler.enabled)

    def _lr_fn(self):
        o, s = self.cfg["Optimizer"], self.cfg["LRScheduler"]
        base = o["lr"] * (self.global_batch / o["base_batch_size"] if o["base_batch_size"] else 1.0)
        warmup = s["warmup_steps"]
        if warmup is None:
            warmup = int(round(s["warmup_epochs"] * self.steps_per_epoch))
        return make_lr_fn(s["name"], base, self.total_steps, min(warmup, self.total_steps),
                          power=s["power"], end_lr=s["end_lr"],
                          boundaries=[b * self.steps_per_epoch for b in s["boundaries"]],
                          gamma=s["gamma"])

    # ----------------------------------------------------------------- steps
    def forward_backward(self, images, labels, loss_factor=1.0):
        """One micro-batch, the last before `optimizer_step`: forward, scaled backward;
        returns the (unscaled) loss."""
        return self.head.loss_value(self._forward_backward(images, labels, loss_factor))

    def _forward_backward(self, images, labels, loss_factor, last=True):
        """`forward_backward` with the loss left on the device (not read). `last`: the step's
        last micro-batch, whose backward all-reduces the backbone's gradients as it goes."""
        amp = self.cfg["AMP"]
        if images.dtype == paddle.uint8:  # the loader's raw HWC images
            images = self.dataset.transform.normalize(images)
        with paddle.amp.auto_cast(enable=amp["enable"], dtype=amp["dtype"], level="O1"):
            emb = self.backbone(images)
        if self.fused_head_update:  # the head's rows are updated inside the backward
            self.head.row_update = self.head_opt.fused_update(self.head)
        loss = self.head(emb, labels)
        if last:
            self.gradient_sum.arm()
        (loss * (self.scaler.scale * loss_factor)).backward()  # end_fused_step clears row_update
        return loss

    def optimizer_step(self, loss=None, losses_finite=True, earlier=()):
        """Sum backbone gradients across ranks, check, unscale, clip, update both parts;
        returns whether the update was applied. A step whose loss or gradients are not all
        finite on some rank is skipped on every rank (the float16 loss scaler then halves its
        scale). `loss`, the last micro-batch's loss tensor, is read in the same host read as
        the check and its label errors (`last_loss`; `step_losses`: those of `earlier`, the
        `head.loss_check`s of the earlier micro-batches, then it); without it the check is read
        alone. `losses_finite`: whether losses read already were finite."""
        params = [p for p in self.backbone.parameters() if not p.stop_gradient]
        fused = self.fused_head_update  # then the head's rows were updated in the backward
        # The head's gradients differ from rank to rank: whether they are finite here rides
        # along in the backbone's all-reduce, so every rank takes the same decision.
        head_ok = (self.head_opt.fused_finite() if fused
                   else self.head_opt.all_gradients_finite(self.head))
        head_bad = self.gradient_sum.finish(extra=paddle.logical_not(head_ok).astype("float32")
                                            .reshape([1]))
        finite = paddle.logical_and(finite_flag([p.grad for p in params if p.grad is not None]),
                                    head_bad.reshape([]) == 0)
        if loss is not None:  # the step's one device read
            self.step_losses, finite = self.head.read_loss_checks(
                list(earlier) + [self.head.loss_check(loss)], finite)
            self.last_loss = self.step_losses[-1]
        else:
            finite = bool(finite)
        finite = finite and losses_finite
        scale = self.scaler.scale  # the scale these gradients carry
        applied = self.scaler.update(finite) and finite
        inv_scale = 1.0 / scale
        if applied:
            if inv_scale != 1.0:
                with paddle.no_grad():
                    for p in params:
                        if p.grad is not None:
                            p.grad.scale_(inv_scale)
            self.backbone_opt.step()
            if fused:
                self.head_opt.end_fused_step(self.head)
            else:
                self.head_opt.step(self.head, grad_scale=inv_scale)
        else:
            if fused:  # slabs with finite gradients were applied in the backward
                self.head_opt.end_fused_step(self.head, applied=self.head_opt.fused_applied > 0)
            self.head_opt.discard(self.head)
        self.backbone_opt.clear_grad(set_to_zero=False)
        self.lr.step()
        self.step += 1
        # A float16 skip counts towards divergence only at the scaler's floor, where halving
        # the scale can no longer help.
        self.nonfinite.record(applied, counts=not self.scaler.enabled
                              or scale <= self.scaler.min_scale)
        return applied

    def train_step(self, micro_batches):
        """One optimizer step over `micro_batches` [(images, labels), ...]; returns the mean loss."""
        checks = []  # the earlier micro-batches' losses and label checks, read with the last
        for i, (images, labels) in enumerate(micro_batches):
            loss = self._forward_backward(images, labels, 1.0 / len(micro_batches),
                                          last=i + 1 == len(micro_batches))
            if i + 1 < len(micro_batches):
                checks.append(self.head.loss_check(loss))
                self.head_opt.stash(self.head)
        self.optimizer_step(loss, earlier=checks)
        return sum(self.step_losses) / len(self.step_losses)

    # ------------------------------------------------------------------ loop
    def _loader(self):
        self.sampler.set_epoch(self.epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        loader = DataLoader(self.dataset, _FromBatch(self.sampler, self.batch_in_epoch),
                            num_workers=self.cfg["Data"]["num_workers"], on_skip=self._skipped,
                            reuse=self.accumulate + 3)  # held: the micro-batches, 2 prefetched
        return Prefetcher(loader) if self.cfg["Data"]["device_prefetch"] else loader

    def _skipped(self, messages):
        """The loader reports samples the dataset replaced: log each, count them against
        Data.skip_bad for this epoch, stop (DataError) beyond it. They count once the step
        that uses them is taken (`_pending_skips` until then), so a run stopped before that
        step and resumed counts them once."""
        limit = self.cfg["Data"]["skip_bad"]
        for msg in messages:
            self._pending_skips += 1
            self.log.warning(f"rank {self.rank}: skipped bad sample "
                             f"{self.skipped_in_epoch + self._pending_skips} of at most {limit} in "
                             f"epoch {self.epoch}: {msg}")
        if self.skipped_in_epoch + self._pending_skips > limit:
            raise DataError(f"{messages[-1]}; rank {self.rank} met more than Data.skip_bad={limit} "
                            f"bad samples in epoch {self.epoch}: fix or remove them")

    def _fetch(self, batches):
        """(micro-batches of the next optimizer step or None at the end of the epoch, None) or
        (None, the DataError that stopped loading them)."""
        micro = []
        try:
            while len(micro) < self.accumulate:
                micro.append(next(batches))
        except StopIteration:
            return None, None  # a last incomplete group of micro-batches is dropped
        except DataError as err:
            return None, err
        return micro, None

    def train(self):
        """Train to `total_steps`, evaluating and checkpointing on the way; returns the history.
        The output folder's lock is released (`close`) when this returns or raises (a later
        call takes it again)."""
        if self._folder is None:
            self._folder = self._claim()
        try:
            return self._train()
        finally:
            self.close()

    def _train(self):
        cfg = self.cfg
        self.log.info(f"plsc: {self.world} rank(s) on {self.device}, {len(self.dataset)} images, "
                      f"{cfg['Loss']['num_classes']} classes ({self.head.num_local} on rank 0, "
                      f"{self.head.param_dtype}), global batch {self.global_batch}, "
                      f"{self.total_steps} steps, head update "
                      f"{'inside the backward' if self.fused_head_update else 'after the backward'}")
        if not self.device.startswith("gpu"):
            for note in (runtime.BLAS_NOTE, cpu_setup.NOTE, cpu_setup.MALLOC_NOTE):
                if note:
                    self.log.info(f"plsc: {note}")
        self.backbone.train()
        self.head.train()
        if self.evaluator is not None and cfg["Eval"]["before_training"] and self.step == 0:
            with self._rank_failures(starting=True):
                self.evaluate()
        with StopSignals() as stop, self._rank_failures():
            while self.step < self.total_steps:
                self._train_epoch(stop)
        self.log.close()
        return self.history

    def _train_epoch(self, stop):
        """Steps to the end of the epoch or of training."""
        with contextlib.closing(iter(self._loader())) as batches:  # its workers end with it
            while self.step < self.total_steps:
                micro, error = self._fetch(batches)
                # Before each step every rank learns of a signal or a data error anywhere.
                signum, failed = stop.agree(data_failed=error is not None)
                if failed >= 0:
                    self._data_stop(error, failed)
                if signum:
                    self._stop(signum)
                if micro is None:
                    self.epoch += 1
                    self.batch_in_epoch = self.skipped_in_epoch = self._pending_skips = 0
                    return
                self.batch_in_epoch += len(micro)  # a checkpoint of this step resumes after them
                self.skipped_in_epoch += self._pending_skips
                self.skipped_total += self._pending_skips
                self._pending_skips = 0
                loss = self.train_step(micro)
                self.history.append((self.step, loss))
                self.log.step(self.step, loss, self.lr.last_lr, self.global_batch, self.epoch)
                if self.nonfinite.run:
                    self._nonfinite_step(loss)
                if self.step % self.log.interval == 0:
                    self._log_step_state()
                self._after_step()

    def _log_step_state(self):
        """VisualDL: AdaFace's statistics, and the bad samples skipped so far on all ranks."""
        if self.cfg["Data"]["skip_bad"]:
            count = to_tensor(np.array([self.skipped_total], np.float32),
                              place=paddle.CPUPlace())  # a host count: no device read
            total = pd.all_reduce_(count, "sum", host_group()) if self.world > 1 else count
            self.log.scalar("data/skipped", total.item(), self.step)
        if self.log.writer is not None:
            for key, value in self._margin_state().items():
                self.log.scalar(f"train/margin_{key}", value, self.step)

    def _data_stop(self, error, failed):
        """Some rank could not load its batch: every rank stops at this step (65)."""
        self.log.close()  # the tool prints the one line (the error names the sample)
        raise error if error is not None else PeerDataError(self.rank, failed, f"after step {self.step}")

    @contextlib.contextmanager
    def _rank_failures(self, starting=False):
        """Turn a collective's error about a dead or silent rank into `RankLost` (`starting`:
        before the first step, where `__init__` may not have set the rank or the log yet)."""
        try:
            yield
        except RuntimeError as err:
            rank = getattr(self, "rank", pd.launched_rank())
            found = peer_failure(err, rank, getattr(self, "world", pd.launched_world_size()))
            if found is None:
                raise
            if starting:
                startup.settle()  # the launcher's SIGTERM to the survivors must not make it 75
            lost = RankLost(rank, None if starting else self.step, found[0], found[1],
                            find_checkpoint("auto", self.cfg["Global"]["output_dir"]))
            if getattr(self, "log", None) is not None:
                self.log.close()
            raise lost from None

    def _nonfinite_step(self, loss):
        """The step just taken was skipped for a non-finite loss or gradient: warn, and stop
        the run (`Diverged`) past Global.max_nonfinite_steps such steps in a row."""
        n, limit = self.nonfinite.run, self.nonfinite.limit
        what = "float16 loss scale at its floor" if self.scaler.enabled else "not finite"
        self.log.info(f"step {self.step}: loss {loss:.6g}, loss or gradients {what}: update "
                         f"skipped ({n} in a row, Global.max_nonfinite_steps={limit})")
        if self.nonfinite.exceeded:
            self._diverged(f"the loss or gradients were not finite in {n} consecutive steps "
                           f"(the last at step {self.step}, loss {loss:.6g}); their updates were "
                           "skipped")

    def _diverged(self, what):
        err = Diverged(what, find_checkpoint("auto", self.output_dir), self.cfg["Optimizer"]["lr"])
        self.log.info(str(err))
        self.log.close()
        raise err

    def _stop(self, signum):
        """A rank was asked to stop: checkpoint this step (unless just done, or unless this
        process took no step: its state is the one it started from) and raise."""
        if not self.history:
            path = None
        else:
            path = self.save() if self._saved_step != self.step else self._saved_path
        err = Preempted(self.step, signum, path)
        self.log.info(str(err))
        self.log.close()
        raise err

    def _after_step(self):
        last = self.step >= self.total_steps
        if self.evaluator is not None and (self.step % self.cfg["Eval"]["interval"] == 0 or last):
            self.evaluate()
        if self.step % self.cfg["Checkpoint"]["interval"] == 0 or last:
            self.save()

    def evaluate(self):
        """Verify every target; keep the backbone of each target's best step so far."""
        pd.sync_buffers(self.backbone)  # rank 0's BatchNorm statistics on every rank: see its docstring
        reports = self.evaluator(self.backbone, with_roc=True)  # the ROC is logged as an image
        for target, report in reports.items():
            self.log.evaluation(self.step, target, report)
            if (self.step > 0 and report["accuracy"] is not None
                    and report["accuracy"] > self.best.get(target, -1.0)):
                self.best[target] = report["accuracy"]
                self._checked_save(save_best, self.output_dir, target, self.step, report,
                                   self.backbone.state_dict())
        self.eval_history.append((self.step, reports))
        return reports

    # ----------------------------------------------------------- checkpoints
    def _head_arrays(self):
        """This rank's class-indexed arrays as tensors (a class a row: with K sub-centres the
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

    def save(self):
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
        for key in ("num_classes", "embedding_size", "sub_centers"):
            if meta.get(key, 1) != getattr(head, key):
                raise ConfigError(f"checkpoint {path} has {key}={meta[key]}, the config "
                                  f"{getattr(head, key)}")
        self.backbone.set_state_dict(backbone_state)
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
        if "head_opt_step_count" in meta:
            self.head_opt.set_state_dict({"step_count": meta["head_opt_step_count"]})
