"""Multi-rank trainer cases, run in one gloo group (conftest.run_ranks; one rank: one
plain process).

    tests/trainer_ranks.py --mode invariant --data DATA --out OUT [--dtype D]
    tests/trainer_ranks.py --mode resume --data DATA --out OUT \
        --resume TAG=DTYPE:CKPT [--resume TAG=DTYPE:CKPT ...]

invariant: two optimizer steps on k ranks from fixed weights and a fixed global
batch, with the class centres stored as `--dtype` (Loss.param_dtype, default float32);
rank 0 reports the resulting backbone and full classifier (tests/rank_report.py),
and the trainer saves a checkpoint (OUT/run/checkpoints/...); then a third step whose head
gradient is NaN on the last rank only must be skipped by every rank (`skip_agreed`); before
it, a backward whose gradients are summed while it runs must give `sum_gradients`' sums
(`overlap_equal`).
resume: for each `--resume`, in turn in the same group, resume CKPT (written by any
number of ranks, in any dtype) on k ranks with Loss.param_dtype DTYPE; rank 0 saves the
re-sharded classifier and optimizer rows as resumed, then two more steps run from them
(their losses and the classifier after them are reported too). Keys of the report are
prefixed with "TAG.".

Head arrays are saved as stored: float32 as float32, bfloat16 as its bits (uint16).
"""
import argparse
import os

import numpy as np

import rank_report
from plsc.process import ending

STEPS = 2
PER_RANK = 3  # samples per rank and step


def global_batches(world, seed=1):
    """The same global batches for any world size: STEPS x (images, labels) of 6 samples."""
    from trainer_common import CLASSES, IMAGE
    rng = np.random.RandomState(seed)
    n = 6
    return [(rng.normal(size=(n, 3, IMAGE, IMAGE)).astype("float32"),
             rng.randint(0, CLASSES, n).astype("int64")) for _ in range(STEPS)]


def full_classifier(seed=2):
    from trainer_common import CLASSES
    return np.random.RandomState(seed).normal(0, 0.1, (CLASSES, 32)).astype("float32")


def run_steps(trainer, rank, world, reset=True):
    """Set the head from the full classifier (`reset`; rounded to nearest into a 16-bit
    head), then run the global batches split by rank; returns the step losses."""
    import paddle
    head = trainer.head
    if reset:
        rows = full_classifier()[head.class_start:head.class_start + head.num_local]
        head.weight.set_value(paddle.to_tensor(rows).astype(head.weight.dtype))
    per = 6 // world
    losses = []
    for images, labels in global_batches(world):
        sl = slice(rank * per, (rank + 1) * per)
        losses.append(trainer.train_step([(paddle.to_tensor(images[sl]),
                                           paddle.to_tensor(labels[sl]))]))
    return losses


def poisoned_step(trainer, rank, world):
    """One more step whose head gradient is NaN on the last rank only (its fused update gets
    NaN slabs; the loss stays finite): every rank must skip its backbone update. Returns
    [share of the ranks whose backbone kept its bits, share that counted the skip]."""
    import paddle
    from plsc.distributed import all_reduce_
    assert trainer.fused_head_update
    before = [p.numpy().copy() for p in trainer.backbone.parameters()]
    opt = trainer.head_opt
    original = opt.fused_update
    if rank == world - 1:
        def poisoned(head, grad_scale=1.0):
            update = original(head, grad_scale)
            return lambda lo, hi, wg, bg: update(lo, hi, wg * float("nan"), bg)
        opt.fused_update = poisoned
    images, labels = global_batches(world, seed=3)[0]
    per = 6 // world
    sl = slice(rank * per, (rank + 1) * per)
    loss = trainer.train_step([(paddle.to_tensor(images[sl]), paddle.to_tensor(labels[sl]))])
    opt.fused_update = original
    kept = all(np.array_equal(p.numpy(), b) for p, b in zip(trainer.backbone.parameters(), before))
    flags = paddle.to_tensor([float(kept), float(trainer.nonfinite.run == 1 and np.isfinite(loss))])
    if world > 1:
        all_reduce_(flags, "sum")
    return flags.numpy() / world


def overlap_check(trainer, rank, world):
    """One more backward whose backbone gradients the trainer sums while it runs
    (`OverlappedSum`), against `sum_gradients` after it on copies of the same local gradients.
    Returns [share of the ranks with every sum equal bit for bit, share whose `extra` came
    back as the number of ranks, the largest difference relative to a gradient's largest
    element]. Nothing is applied (the head's update is left unfused and
    discarded, the backbone's gradients cleared)."""
    import paddle
    from plsc.distributed import all_reduce_
    from plsc.train.grad_sync import sum_gradients

    class Holder:
        def __init__(self, grad):
            self.grad = grad
    images, labels = global_batches(world, seed=4)[0]
    per = 6 // world
    sl = slice(rank * per, (rank + 1) * per)
    trainer.cfg["Optimizer"]["fused_head_update"] = False
    trainer._forward_backward(paddle.to_tensor(images[sl]), paddle.to_tensor(labels[sl]), 1.0)
    params = [p for p in trainer.backbone.parameters() if not p.stop_gradient]
    copies = [Holder(p.grad.clone()) for p in params if p.grad is not None]
    extra = trainer.gradient_sum.finish(extra=paddle.ones([1], "float32"))
    sum_gradients(copies, extra=paddle.ones([1], "float32"))
    summed = [p.grad.numpy() for p in params if p.grad is not None]
    equal = all(np.array_equal(a, c.grad.numpy()) for a, c in zip(summed, copies))
    worst = max(float(np.abs(a - c.grad.numpy()).max() / np.abs(c.grad.numpy()).max())
                for a, c in zip(summed, copies))
    trainer.backbone_opt.clear_grad(set_to_zero=False)
    trainer.head_opt.discard(trainer.head)
    trainer.cfg["Optimizer"]["fused_head_update"] = True
    flags = paddle.to_tensor([float(equal), float(extra.numpy()[0] == world)])
    worst = paddle.to_tensor([worst], dtype="float32")
    if world > 1:
        all_reduce_(flags, "sum")
        all_reduce_(worst, "max")
    return np.concatenate([flags.numpy() / world, worst.numpy()])


def gather_head(trainer, name):
    """A class-indexed array of the head (weight or optimizer state) from every rank, as
    stored (bfloat16: its bits as uint16)."""
    import paddle
    from plsc.distributed import gather_concat
    head = trainer.head
    tensor = head.weight if name == "weight" else trainer.head_opt.state_dict()[name]
    dtype = str(tensor.dtype).replace("paddle.", "")
    local = tensor.astype("float32").numpy()  # exact; gloo gathers float32
    shard = head.partition.shard_size
    padded = np.zeros((shard,) + local.shape[1:], local.dtype)
    padded[:len(local)] = local
    rows = gather_concat(paddle.to_tensor(padded)).numpy()
    part = head.partition
    rows = np.concatenate([rows[r * shard:r * shard + part.num_local(r)]
                           for r in range(part.world_size)])
    if dtype == "bfloat16":
        return (rows.view(np.uint32) >> 16).astype(np.uint16)
    assert dtype == "float32", dtype
    return rows


def run(mode, data, out, dtype, resumes, config_backbone=False):
    import paddle
    from trainer_common import config, make_backbone
    from plsc.distributed import get_rank, get_world_size, init
    from plsc.train import Trainer

    paddle.set_device("cpu")
    init()
    rank, world = get_rank(), get_world_size()
    if mode == "invariant":
        cfg = config(data, os.path.join(out, "run"), Loss={"param_dtype": dtype})
        trainer = Trainer(cfg, backbone=make_backbone(0))
        run_steps(trainer, rank, world)
        weight = gather_head(trainer, "weight")
        velocity = gather_head(trainer, "weight.velocity")
        trainer.save()
        overlap_equal = overlap_check(trainer, rank, world)
        skip_agreed = poisoned_step(trainer, rank, world)
        if rank == 0:
            backbone = {f"backbone.{n}": p.numpy() for n, p in trainer.backbone.named_parameters()}
            rank_report.write_arrays(dict(head=weight, velocity=velocity, skip_agreed=skip_agreed,
                                          overlap_equal=overlap_equal, **backbone))
        return
    results = {}
    for spec in resumes:
        tag, rest = spec.split("=", 1)
        dtype, checkpoint = rest.split(":", 1)
        cfg = config(data, os.path.join(out, f"run_{tag}"), Global={"checkpoint": checkpoint},
                     Loss={"param_dtype": dtype})
        trainer = Trainer(cfg, backbone=None if config_backbone else make_backbone(0))
        result = {"head": gather_head(trainer, "weight"),
                  "velocity": gather_head(trainer, "weight.velocity"),
                  "step": trainer.step, "step_count": trainer.head_opt.step_count,
                  "dtype": str(trainer.head.weight.dtype).replace("paddle.", ""),
                  "num_local": trainer.head.num_local}
        result.update({f"backbone.{n}": p.numpy() for n, p in trainer.backbone.named_parameters()})
        result["losses"] = run_steps(trainer, rank, world, reset=False)  # training goes on
        result["after"] = gather_head(trainer, "weight")
        results.update({f"{tag}.{k}": v for k, v in result.items()})
    if rank == 0:
        rank_report.write_arrays(results)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("invariant", "resume"), required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32", help="Loss.param_dtype of an invariant run")
    p.add_argument("--resume", action="append", default=[], metavar="TAG=DTYPE:CKPT",
                   help="resume mode: a checkpoint to resume into Loss.param_dtype DTYPE")
    p.add_argument("--config-backbone", action="store_true",
                   help="resume mode: the config's backbone (Model.name) instead of FlatNet")
    a = p.parse_args()
    if a.mode == "resume" and not a.resume:
        p.error("--mode resume needs at least one --resume TAG=DTYPE:CKPT")
    run(a.mode, a.data, a.out, a.dtype, a.resume, a.config_backbone)


if __name__ == "__main__":
    main()
    ending.end(0)
