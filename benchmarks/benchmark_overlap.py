"""Does summing the backbone's gradients during the backward help? Time of one backbone step
(forward, backward, gradient all-reduce across the ranks) on K gloo ranks spawned here, with
the all-reduce after the backward (`sum_gradients`, the trainer before issue 35) and started
by the parameters' hooks during it (`OverlappedSum`), interleaved step by step (A B A B) in
the same processes, beside the same step without any all-reduce (compute only); one JSON line
from rank 0 with the median step times.

    python benchmarks/benchmark_overlap.py --backbone MobileFaceNet --batch 16 --steps 8
    python benchmarks/benchmark_overlap.py --backbone IResNet18 --batch 8 --steps 6
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import plsc  # noqa: E402,F401  -- before Paddle: sets MKL's dispatch on AMD processors


def run(args):
    import numpy as np
    import paddle
    import paddle.distributed as dist
    from plsc.process import runtime
    from plsc.models import build_model
    from plsc.train.grad_sync import OverlappedSum, sum_gradients

    paddle.set_device("cpu")
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    runtime.set_cpu_threads(args.threads)
    paddle.seed(0)
    model = build_model(args.backbone, embedding_size=512, input_size=(112, 112), dropout=0.0)
    model.train()
    params = [p for p in model.parameters() if not p.stop_gradient]
    overlapped = OverlappedSum(params)
    images = paddle.to_tensor(np.random.RandomState(rank).normal(
        size=(args.batch, 3, 112, 112)).astype("float32"))

    def step(mode):
        start = time.perf_counter()
        if mode == "overlap":
            overlapped.arm()
        loss = model(images).square().mean()
        loss.backward()
        if mode == "after":
            sum_gradients(params)
        elif mode == "overlap":
            overlapped.finish()
        seconds = time.perf_counter() - start
        for p in params:
            p.clear_gradient(set_to_zero=False)
        return seconds

    modes = ("after", "overlap", "compute_only")
    for mode in modes:  # warm-up
        step(mode)
    times = {mode: [] for mode in modes}
    for _ in range(args.steps):
        for mode in modes:
            times[mode].append(step(mode))
    if rank == 0:
        grad_mb = sum(p.size for p in params) * 4 / 2 ** 20
        print(json.dumps({
            "benchmark": "overlap", "backbone": args.backbone, "ranks": world,
            "batch_per_rank": args.batch, "threads_per_rank": runtime.kernel_threads(),
            "gradient_mb": round(grad_mb, 1), "buckets": len(overlapped.buckets),
            "steps": args.steps, "load_avg_1m": os.getloadavg()[0],
            **{f"median_s_{m}": round(float(np.median(t)), 4) for m, t in times.items()},
            "overlap_over_after": round(float(np.median(times["overlap"]) /
                                              np.median(times["after"])), 3),
        }), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backbone", default="MobileFaceNet")
    p.add_argument("--batch", type=int, default=16, help="images per rank")
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    args = p.parse_args()
    import paddle.distributed as dist
    dist.spawn(run, args=(args,), nprocs=args.ranks)


if __name__ == "__main__":
    main()
