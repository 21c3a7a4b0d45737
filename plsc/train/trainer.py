"""The training loop: data-parallel backbone, model-parallel head."""
import contextlib
import functools
import os
import time

import numpy as np
import paddle

from .. import distributed as pd
from ..process import cpu_setup, runtime
from ..config import ConfigError, dump_config
from ..kernels.cpu_kernels import finite_flag
from ..kernels.onednn import release_scratch
from ..data import DataError, DataLoader, DistributedBatchSampler, Prefetcher
from ..data.sampler import FromBatch
from ..data.tensors import to_tensor
from ..nn import PartialFC
from ..optim.schedule import StepLR, make_lr_fn
from ..checkpoint import (CheckpointManager, agree_checkpoint, remove_leftovers, repair_latest,
                          save_best)
from ..parts import build_backbone, load_pretrained
from ..checkpoint.lock import claim_folder
from ..embedding import VerificationEvaluator
from ..fileio import atomic_write
from .amp import build_loss_scaler
from .builders import (build_backbone_optimizer, build_head_optimizer, build_margin_from_config,
                       build_train_dataset)
from .checkpointing import Checkpointing
from .closing import closing_block
from .divergence import NonFiniteSteps
from .grace import SaveClock
from .grad_sync import OverlappedSum
from .logger import TrainLogger, visualdl_dir
from .preemption import StopSignals, host_group
from .stopping import Stopping, reports_lost_ranks
from .timers import step_timers

__all__ = ["Trainer"]


def _closed_on_error(init):
    """An `__init__` that releases what it took (the output folder's lock) when it raises; once
    train.log is open, the reason the run did not start is its last line."""
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except BaseException as err:
            if getattr(self, "log", None) is not None and isinstance(err, Exception):
                self.log.file_only(f"the run did not start: {err}")
            self.close()
            raise
    return wrapper


class Trainer(Checkpointing, Stopping):
    """Builds everything a config describes and trains it.

    `backbone` may be given as a `paddle.nn.Layer` instead of `Model.name`.
    The output folder is locked from the start (`plsc.checkpoint.lock`) until `train()`
    returns or raises, `close()`, or the end of the object.
    """

    @reports_lost_ranks
    @_closed_on_error
    def __init__(self, cfg, backbone=None):
        self.started = time.monotonic()  # the run's wall time (its closing block) counts from here
        self.cfg = cfg
        g = cfg["Global"]
        self.device = runtime.start(cfg)
        self.rank, self.world = pd.get_rank(), pd.get_world_size()
        self.output_dir = g["output_dir"]
        self._folder = self._claim()  # before anything touches the folder
        amp = cfg["AMP"]
        if amp["enable"] and not self.device.startswith("gpu"):
            raise ConfigError("AMP.enable is true but training runs on the CPU; AMP needs a GPU")
        paddle.seed(g["seed"])
        np.random.seed(g["seed"])
        self._open_log(cfg)  # before the data: their generation is logged
        self._build_data(cfg)
        self._build_model(cfg, backbone)
        self._build_optimizers(cfg)
        self._build_outputs(cfg)
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self._steps_in_process = 0  # steps taken by this process (a resumed run counts anew)
        self.skipped_in_epoch = self.skipped_total = 0  # bad samples replaced on this rank
        self._pending_skips = 0  # ... in batches loaded for a step not taken yet
        self.history = []  # (step, loss) of every optimizer step of this process
        self.step_losses = []  # the last step's micro-batch losses (`optimizer_step`)
        self.eval_history = []
        self.best = {}  # target -> (best accuracy so far, its step)
        self._saved_step = self._saved_path = None  # the last checkpoint this process wrote
        if self.rank == 0:
            self._tidy_output_dir()
        if g["checkpoint"]:
            self._resume_configured(g["checkpoint"])
        if self.rank == 0:
            os.makedirs(self.output_dir, exist_ok=True)
            atomic_write(os.path.join(self.output_dir, "config.yaml"), dump_config(cfg))

    def _build_data(self, cfg):
        """The training set (within Data.skip_bad), this rank's batch sampler and the step
        counts they give."""
        g, d = cfg["Global"], cfg["Data"]
        self.accumulate = cfg["Optimizer"]["accumulate_steps"]
        self.dataset = build_train_dataset(cfg, say=self.log.info)
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

    def _build_model(self, cfg, backbone):
        """The backbone (given, or `Model.name`; with its pretrained weights) and this rank's
        shard of the head."""
        g, m, loss = cfg["Global"], cfg["Model"], cfg["Loss"]
        self.backbone_given = backbone is not None  # resume checks Model.name only when built
        self.backbone = backbone if backbone is not None else build_backbone(cfg)
        if g["pretrained"]:
            load_pretrained(self.backbone, g["pretrained"])  # .pdparams or arcface_torch's .pt
        paddle.seed(g["seed"] + 1 + self.rank)  # class centres differ from rank to rank
        self.head = PartialFC(m["embedding_size"], loss["num_classes"], build_margin_from_config(loss),
                              sample_ratio=loss["sample_ratio"], seed=g["seed"],
                              chunk_size="auto" if loss["chunk_size"] is None else loss["chunk_size"],
                              logits_budget=int(loss["logits_budget_mb"] * (1 << 20)),
                              param_dtype=loss["param_dtype"], sub_centers=loss["sub_centers"],
                              interclass_filtering_threshold=loss["interclass_filtering_threshold"],
                              check_inputs="labels")  # the sampler makes equal batches
        paddle.seed(g["seed"] + 7919 * (self.rank + 1))  # dropout etc. per rank

    def _build_optimizers(self, cfg):
        """The learning rate, both optimizers, the backbone's gradient sum, the loss scaler and
        the count of non-finite steps."""
        self.lr = StepLR(self._lr_fn())
        self.backbone_opt = build_backbone_optimizer(cfg, self.backbone.parameters(), self.lr)
        # The backbone's gradients are summed across ranks while the backward goes on.
        self.gradient_sum = OverlappedSum(self.backbone.parameters(),
                                          dtype=cfg["Optimizer"]["grad_allreduce_dtype"],
                                          mode=cfg["Optimizer"]["grad_sync"])
        self.head_opt = build_head_optimizer(cfg, self.lr)
        self.scaler = build_loss_scaler(cfg["AMP"])
        self.nonfinite = NonFiniteSteps(cfg["Global"]["max_nonfinite_steps"])

    def _open_log(self, cfg):
        """The run's log (`train.log`, the console, VisualDL), on rank 0."""
        lg = cfg["Logging"]
        self.log = TrainLogger(self.output_dir, 0, cfg["Global"]["log_interval"],
                               enabled=self.rank == 0, visualdl=lg["visualdl"],
                               progress_bar=lg["progress_bar"])

    def _build_outputs(self, cfg):
        """The checkpoint manager, the evaluator (None without Eval.targets); the log's count
        of steps."""
        e = cfg["Eval"]
        self.ckpt = CheckpointManager(self.output_dir, cfg["Checkpoint"]["keep_last"])
        self.evaluator = (VerificationEvaluator(e["root"], e["targets"], cfg["Data"]["image_size"],
                                                e["batch_size"]) if e["targets"] else None)
        self.log.begin(self.total_steps)
        self.save_clock = SaveClock(cfg["Checkpoint"]["grace_seconds"])

    def _tidy_output_dir(self):
        """Rank 0: remove what a crashed save left behind, repair `latest`, log the lock's
        notes."""
        removed = remove_leftovers(self.output_dir)
        if removed:
            self.log.info(f"removed {len(removed)} leftover(s) of an interrupted save under "
                          f"{self.output_dir}: {', '.join(removed)}")
        for note in self._folder.notes:  # the lock's limits on this file system
            self.log.warning(note)
        repaired = repair_latest(self.output_dir)  # a save killed before rewriting `latest`
        if repaired:
            self.log.info(repaired)

    def _resume_configured(self, checkpoint):
        """Resume from Global.checkpoint (`checkpoint`: a path or "auto"), agreed by every
        rank; "auto" with nothing to resume starts fresh."""
        path = agree_checkpoint(checkpoint, self.output_dir,
                                self.cfg["Checkpoint"]["verify"], warn=self.log.warning)
        if path is None:  # Global.checkpoint=auto and nothing to resume
            self.log.info(f"Global.checkpoint=auto: no checkpoint under "
                          f"{os.path.join(self.output_dir, 'checkpoints')}; starting fresh")
        else:
            if checkpoint == "auto":
                self.log.info(f"Global.checkpoint=auto: resuming from {path}")
            self.resume(path)

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
                          gamma=s["gamma"], warmup_indexing=s["warmup_indexing"])

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
        loader = DataLoader(self.dataset, FromBatch(self.sampler, self.batch_in_epoch),
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

    def _fetch(self, batches, stop):
        """(micro-batches of the next optimizer step or None at the end of the epoch, None) or
        (None, the DataError that stopped loading them); (None, None) also when the error is
        part of a stop (`stop.claims`: a loader worker killed by its signal), which the
        agreement that follows then carries out."""
        micro = []
        try:
            while len(micro) < self.accumulate:
                micro.append(next(batches))
        except StopIteration:
            return None, None  # a last incomplete group of micro-batches is dropped
        except DataError as err:
            return None, None if stop.claims(err) else err
        return micro, None

    def train(self):
        """Train to `total_steps`, evaluating and checkpointing on the way; returns the history.
        However it ends, the log gets the run's closing block (`closing_block`). The output
        folder's lock is released (`close`) when this returns or raises (a later call takes it
        again)."""
        if self._folder is None:
            self._folder = self._claim()
        ended = None  # what ended the run: None when it finished
        try:
            with step_timers(self):  # opt-in (PLSC_STEP_TIMES): per-phase step times, timers.py
                return self._train()
        except BaseException as err:
            ended = err
            raise
        finally:
            try:
                self._close_run(ended)
            finally:
                self.close()

    def _close_run(self, error=None):
        """Rank 0 logs the closing block of a run ended by `error` (None: finished)."""
        if self.log.enabled:
            for line in closing_block(self, error):
                self.log.info(line)

    def _train(self):
        cfg = self.cfg
        self.log.info(f"plsc: {self.world} rank(s) on {self.device}, {len(self.dataset)} images, "
                      f"{cfg['Loss']['num_classes']} classes ({self.head.num_local} on rank 0, "
                      f"{self.head.param_dtype}), global batch {self.global_batch}, "
                      f"{self.total_steps} steps, head update "
                      f"{'inside the backward' if self.fused_head_update else 'after the backward'}")
        cluster = pd.slurm.description()
        if cluster:
            self.log.info(f"plsc: {cluster}")
        if not self.device.startswith("gpu"):
            for note in (runtime.BLAS_NOTE, cpu_setup.NOTE, cpu_setup.MALLOC_NOTE):
                if note:
                    self.log.info(f"plsc: {note}")
        self.backbone.train()
        self.head.train()
        if self.evaluator is not None and cfg["Eval"]["before_training"] and self.step == 0:
            with self._rank_failures(starting=True):
                self.evaluate()
            cpu_setup.release_freed_memory()  # the steps do not start among its freed blocks
        with StopSignals() as stop, self._rank_failures():
            self._check_grace(probe=True)
            while self.step < self.total_steps:
                self._train_epoch(stop)
        self.log.close()
        return self.history

    def _train_epoch(self, stop):
        """Steps to the end of the epoch or of training."""
        with contextlib.closing(iter(self._loader())) as batches:  # its workers end with it
            while self.step < self.total_steps:
                micro, error = self._fetch(batches, stop)
                # Before each step every rank learns of a signal or a data error anywhere.
                signum, failed = stop.agree(data_failed=error is not None)
                if failed >= 0:
                    self._data_stop(error, failed)
                if signum:
                    self._stop(signum, stop.seconds_since_signal())
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

    def _after_step(self):
        last = self.step >= self.total_steps
        self._steps_in_process += 1
        # malloc's free pages go back while the pages a step touches may still change: after
        # the first steps, an evaluation or a checkpoint (cpu_setup.release_freed_memory)
        settle = self._steps_in_process <= cpu_setup.SETTLING_STEPS
        if self.evaluator is not None and (self.step % self.cfg["Eval"]["interval"] == 0 or last):
            cpu_setup.release_freed_memory()  # the evaluation's batches do not fit the step's
            self.evaluate()                   # freed blocks: it would add to what they keep
            settle = True
        if self.step % self.cfg["Checkpoint"]["interval"] == 0 or last:
            self.save()
            settle = True
            if not last:
                self._check_grace()
        if settle and not last:
            cpu_setup.release_freed_memory()

    def evaluate(self):
        """Verify every target; keep the backbone of each target's best step so far."""
        pd.sync_buffers(self.backbone)  # rank 0's BatchNorm statistics on every rank: see its docstring
        reports = self.evaluator(self.backbone, with_roc=True)  # the ROC is logged as an image
        for target, report in reports.items():
            self.log.evaluation(self.step, target, report)
            if (self.step > 0 and report["accuracy"] is not None
                    and report["accuracy"] > self.best.get(target, (-1.0,))[0]):
                self.best[target] = (report["accuracy"], self.step)
                kept = self._checked_save(save_best, self.output_dir, target, self.step, report,
                                          self.backbone.state_dict())
                self.log.info(f"[{target}] best so far: the backbone of step {self.step} "
                              f"written to {kept}")
        self.eval_history.append((self.step, reports))
        # its batch grew the convolutions' shared scratch past the steps' sizes: not kept
        release_scratch()
        return reports
