"""Which 8-bit map suits the head's optimizer state: trains one head with each choice and prints
JSON.

A PartialFC head (int8 centres) is trained by itself on fixed embeddings: each class is a
random unit direction, its samples that direction plus noise, so the loss can fall far and the
optimizer state spans the range a real run's does (large rows for the classes of the batch,
small ones for the rest). Every run sees the same batches; the reference keeps its optimizer
state in float32. Reported for each map choice: the final mean loss over the last 20 steps,
the top-1 accuracy of the embeddings against the centres, and the largest |update| a step made
relative to the reference's (a state read as 0 where it was not divides AdamW's update by ε).

    python benchmarks/benchmark_int8_state.py --steps 300
"""
import argparse
import json
import sys
import time


import numpy as np
import paddle

from plsc.loss import CosFace
from plsc.nn import PartialFC
from plsc.optim import SparseAdamW, SparseMomentum
from plsc.storage import read as rows_f32

CHOICES = {
    "adamw": [("float32", None), ("int8", {"moment1": "int8", "moment2": "int8"}),
              ("int8", {"moment1": "int8", "moment2": "uint8_log"}),
              ("int8", {"moment1": "int8_log", "moment2": "int8"}),
              ("int8", {"moment1": "int8_log", "moment2": "uint8_log"})],
    "sgd": [("float32", None), ("int8", {"velocity": "int8"}), ("int8", {"velocity": "int8_log"})],
}


def make_data(args):
    rng = np.random.RandomState(args.seed)
    centres = rng.normal(size=(args.classes, args.dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    labels = rng.randint(0, args.classes, size=(args.steps, args.batch))
    noise = rng.normal(scale=args.noise / np.sqrt(args.dim),
                       size=(args.steps, args.batch, args.dim))
    return (centres[labels] + noise).astype(np.float32), labels.astype(np.int64), centres


def run(args, kind, state_dtype, maps, data):
    """Train the head with `kind`'s optimizer, its state stored as `state_dtype` (8-bit maps
    `maps`, or None); (result dict, the optimizer)."""
    feats, labels, centres = data
    paddle.seed(args.seed)
    head = PartialFC(args.dim, args.classes, CosFace(30.0, 0.35), sample_ratio=args.ratio,
                     seed=args.seed, param_dtype="int8")
    if kind == "adamw":
        opt = SparseAdamW(args.lr_adamw, weight_decay=0.05, state_dtype=state_dtype, seed=args.seed)
    else:
        opt = SparseMomentum(args.lr_sgd, momentum=0.9, weight_decay=5e-4, state_dtype=state_dtype,
                             seed=args.seed)
    if maps:
        opt.int8_maps = maps
    losses, update_norms = [], []
    for t in range(args.steps):
        before = rows_f32(head.weight).numpy()
        head.row_update = opt.fused_update(head)
        loss = head(paddle.to_tensor(feats[t]), paddle.to_tensor(labels[t]))
        loss.backward()
        opt.end_fused_step(head)
        losses.append(float(loss))
        step = np.abs(rows_f32(head.weight).numpy() - before)
        update_norms.append(float(step.max()))
    w = rows_f32(head.weight).numpy()
    w /= np.linalg.norm(w, axis=1, keepdims=True)
    accuracy = float((np.argmax(centres @ w.T, axis=1) == np.arange(args.classes)).mean())
    return {"loss_last20": float(np.mean(losses[-20:])), "centre_top1": accuracy,
            "largest_step": float(np.max(update_norms))}, opt


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=2000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ratio", type=float, default=0.3, help="Partial FC sample ratio")
    p.add_argument("--noise", type=float, default=1.0, help="sample noise (norm, relative)")
    p.add_argument("--lr-adamw", type=float, default=0.01)
    p.add_argument("--lr-sgd", type=float, default=0.5)
    p.add_argument("--optimizers", nargs="+", default=["adamw", "sgd"], choices=list(CHOICES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    data = make_data(args)
    out = {"args": vars(args), "runs": []}
    for kind in args.optimizers:
        for state_dtype, maps in CHOICES[kind]:
            start = time.perf_counter()
            result, _ = run(args, kind, state_dtype, maps, data)
            out["runs"].append(dict(optimizer=kind, state=maps or state_dtype,
                                    seconds=round(time.perf_counter() - start, 1), **result))
            print(json.dumps(out["runs"][-1]), file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
