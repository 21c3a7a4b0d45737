"""Train a toy embedding model with a class-sharded ArcFace head and Partial FC.

    python -m paddle.distributed.launch --nproc_per_node 2 demo/partial_fc_demo.py
    python demo/partial_fc_demo.py            # one process works too

The "backbone" is a small MLP, data-parallel: every rank feeds its own
samples, and its gradients are summed across ranks (the head's loss is the
global-batch mean, so each rank's backbone gradient covers its own samples).
The head is model-parallel: each rank holds only its classes, samples
`--sample-ratio` of them a step (the batch's positives always among them) and
`SparseMomentum` updates the sampled rows and their momentum only: the loop of
README's "The head in a hand-written loop".
"""
import argparse

import plsc.distributed as pd  # first: plsc sets MKL's dispatch before Paddle loads
import numpy as np
import paddle
from paddle import nn

from plsc.loss import ArcFace
from plsc.nn import PartialFC
from plsc.optim import SparseMomentum
from plsc.process import ending


def make_batch(rng, centres, batch_size, noise):
    labels = rng.randint(0, len(centres), batch_size)
    x = centres[labels] + noise * rng.normal(size=(batch_size, centres.shape[1]))
    return paddle.to_tensor(x.astype("float32")), paddle.to_tensor(labels.astype("int64"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--input-dim", type=int, default=64)
    p.add_argument("--embedding-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--sample-ratio", type=float, default=0.1,
                   help="Partial FC: the fraction of each rank's classes sampled a step")
    args = p.parse_args()

    pd.init()
    rank, world = pd.get_rank(), pd.get_world_size()
    paddle.seed(0)  # the same backbone initialisation on every rank
    backbone = nn.Sequential(nn.Linear(args.input_dim, 128), nn.PReLU(),
                             nn.Linear(128, args.embedding_size))
    head = PartialFC(args.embedding_size, args.num_classes, ArcFace(s=32.0, m=0.3),
                     sample_ratio=args.sample_ratio)
    opt = paddle.optimizer.Momentum(args.lr, momentum=0.9, parameters=backbone.parameters())
    head_opt = SparseMomentum(learning_rate=args.lr, momentum=0.9, weight_decay=5e-4)

    centres = np.random.RandomState(1234).normal(size=(args.num_classes, args.input_dim))
    rng = np.random.RandomState(100 + rank)  # each rank draws its own samples
    for step in range(1, args.steps + 1):
        x, y = make_batch(rng, centres, args.batch_size, noise=0.5)
        loss = head(backbone(x), y)
        loss.backward()
        for param in backbone.parameters():  # data parallel: sum the backbone gradients
            pd.all_reduce_(param.grad, "sum")
        opt.step()
        opt.clear_grad()
        head_opt.step(head)  # the sampled rows and their momentum only
        if rank == 0 and (step % 20 == 0 or step == 1):
            print(f"step {step:4d}  loss {float(loss):.4f}  "
                  f"(ranks {world}, classes {head.class_start}..{head.class_start + head.num_local - 1} here, "
                  f"{head.num_sample} sampled)",
                  flush=True)


if __name__ == "__main__":
    main()
    ending.end(0)  # a launched rank leaves without the C++ static destructors (docs/faults.md)
