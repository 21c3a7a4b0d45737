"""Multi-rank engine cases, run in one spawned gloo group.

    python tests/engine_ranks.py --nprocs K --mode invariant --data DATA --out OUT
    python tests/engine_ranks.py --nprocs K --mode resume --data DATA --out OUT --checkpoint CKPT

invariant: two optimizer steps on k ranks from fixed weights and a fixed global
batch; rank 0 saves the resulting backbone and full classifier to OUT/result.npz,
and the trainer saves a checkpoint (OUT/run/checkpoints/...).
resume: resume CKPT (written by any number of ranks) on k ranks; rank 0 saves
the re-sharded classifier and optimizer rows, then two more steps run.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS = 2
PER_RANK = 3  # samples per rank and step


def global_batches(world, seed=1):
    """The same global batches for any world size: STEPS x (images, labels) of 6 samples."""
    from engine_common import CLASSES, IMAGE
    rng = np.random.RandomState(seed)
    n = 6
    return [(rng.normal(size=(n, 3, IMAGE, IMAGE)).astype("float32"),
             rng.randint(0, CLASSES, n).astype("int64")) for _ in range(STEPS)]


def full_classifier(seed=2):
    from engine_common import CLASSES
    return np.random.RandomState(seed).normal(0, 0.1, (CLASSES, 32)).astype("float32")


def run_steps(trainer, rank, world):
    """Set the head from the full classifier, then run the global batches split by rank."""
    import paddle
    head = trainer.head
    head.weight.set_value(full_classifier()[head.class_start:head.class_start + head.num_local])
    per = 6 // world
    for images, labels in global_batches(world):
        sl = slice(rank * per, (rank + 1) * per)
        trainer.train_step([(paddle.to_tensor(images[sl]), paddle.to_tensor(labels[sl]))])


def gather_head(trainer, name):
    """A class-indexed array of the head (weight or optimizer state) from every rank."""
    import paddle
    from plsc.distributed import gather_concat
    head = trainer.head
    if name == "weight":
        local = head.weight.numpy()
    else:
        local = trainer.head_opt.state_dict()[name].numpy()
    shard = head.partition.shard_size
    padded = np.zeros((shard,) + local.shape[1:], local.dtype)
    padded[:len(local)] = local
    rows = gather_concat(paddle.to_tensor(padded)).numpy()
    part = head.partition
    return np.concatenate([rows[r * shard:r * shard + part.num_local(r)] for r in range(part.world_size)])


def run(mode, data, out, checkpoint):
    import paddle
    from engine_common import config, make_backbone
    from plsc.distributed import get_rank, get_world_size, init
    from plsc.engine import Trainer

    paddle.set_device("cpu")
    init()
    rank, world = get_rank(), get_world_size()
    if mode == "invariant":
        cfg = config(data, os.path.join(out, "run"))
        trainer = Trainer(cfg, backbone=make_backbone(0))
        run_steps(trainer, rank, world)
        weight = gather_head(trainer, "weight")
        velocity = gather_head(trainer, "weight.velocity")
        trainer.save()
        if rank == 0:
            np.savez(os.path.join(out, "result.npz"), head=weight, velocity=velocity,
                     **{f"backbone.{n}": p.numpy() for n, p in trainer.backbone.named_parameters()})
    else:
        cfg = config(data, os.path.join(out, "run"), Global={"checkpoint": checkpoint})
        trainer = Trainer(cfg, backbone=make_backbone(0))
        weight = gather_head(trainer, "weight")
        velocity = gather_head(trainer, "weight.velocity")
        backbone = {f"backbone.{n}": p.numpy() for n, p in trainer.backbone.named_parameters()}
        step = trainer.step
        run_steps(trainer, rank, world)  # training goes on after re-sharding
        if rank == 0:
            np.savez(os.path.join(out, "result.npz"), head=weight, velocity=velocity, step=step,
                     num_local=trainer.head.num_local, **backbone)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nprocs", type=int, required=True)
    p.add_argument("--mode", choices=("invariant", "resume"), required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--checkpoint")
    a = p.parse_args()
    if a.nprocs == 1:
        return run(a.mode, a.data, a.out, a.checkpoint)
    import paddle.distributed as dist
    dist.spawn(run, args=(a.mode, a.data, a.out, a.checkpoint), nprocs=a.nprocs)


if __name__ == "__main__":
    main()
