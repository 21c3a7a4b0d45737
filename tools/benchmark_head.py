"""Benchmark one forward+backward of the PartialFC head; one JSON line per rank.

    python -m paddle.distributed.launch --nproc_per_node 2 tools/benchmark_head.py \
        --num-classes 200000 --embedding-size 512 --batch-size 128

Measured in the same run: the head's step time, the time of its three GEMMs
alone on the same shapes (logits, embedding gradient, weight gradient), and
the peak memory the step allocates, in units of one `[N, num_local]` float32
buffer (N = global batch). `peak_extra_buffers` leaves out the gradients the
step returns (they outlive it and any head needs them); `peak_total_buffers`
counts everything allocated during the step.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import paddle
from paddle.base import core

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import plsc.distributed as pd  # noqa: E402
from plsc.loss import MARGINS  # noqa: E402
from plsc.nn import PartialFC  # noqa: E402


class MemoryMeter:
    """Allocated-bytes counters of Paddle's allocator for the current device."""

    def __init__(self):
        self.dev = paddle.get_device()
        self.host = self.dev == "cpu"
        self.idx = 0 if self.host else int(self.dev.split(":")[1])

    def reset_peak(self):
        (core.host_memory_stat_reset_peak_value if self.host
         else core.device_memory_stat_reset_peak_value)("Allocated", self.idx)

    def current(self):
        return (core.host_memory_stat_current_value if self.host
                else core.device_memory_stat_current_value)("Allocated", self.idx)

    def peak(self):
        return (core.host_memory_stat_peak_value if self.host
                else core.device_memory_stat_peak_value)("Allocated", self.idx)


def sync():
    if paddle.get_device() != "cpu":
        paddle.device.synchronize()


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-classes", type=int, default=200000, help="total classes C (default 200000)")
    p.add_argument("--embedding-size", type=int, default=512, help="embedding width d (default 512)")
    p.add_argument("--batch-size", type=int, default=128,
                   help="per-rank batch; the global batch N is this times the world size (default 128)")
    p.add_argument("--margin", default="arcface", choices=sorted(MARGINS), help="default arcface")
    p.add_argument("--steps", type=int, default=3, help="timed repetitions, median reported (default 3)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    pd.init()
    rank, world = pd.get_rank(), pd.get_world_size()
    paddle.seed(args.seed + rank)
    d, b = args.embedding_size, args.batch_size
    n = b * world
    head = PartialFC(d, args.num_classes, MARGINS[args.margin]())
    rng = np.random.RandomState(args.seed + rank)
    x = paddle.to_tensor(rng.normal(size=(b, d)).astype("float32"))
    x.stop_gradient = False
    y = paddle.to_tensor(rng.randint(0, args.num_classes, b).astype("int64"))

    def step():
        x.clear_gradient(set_to_zero=False)
        head.clear_gradients(set_to_zero=False)
        head(x, y).backward()

    step()  # warm-up
    meter = MemoryMeter()
    x.clear_gradient(set_to_zero=False)
    head.clear_gradients(set_to_zero=False)
    base = meter.current()
    meter.reset_peak()
    head(x, y).backward()
    sync()
    peak = meter.peak() - base
    retained = meter.current() - base
    step_time = timed(step, args.steps)

    # The three GEMMs alone, same shapes: logits, embedding grad, weight grad.
    feats = paddle.randn([n, d])
    w = head.weight.detach()
    logits = paddle.matmul(feats, w, transpose_y=True)
    gemms = [lambda: paddle.matmul(feats, w, transpose_y=True),
             lambda: paddle.matmul(logits, w),
             lambda: paddle.matmul(logits, feats, transpose_x=True)]
    gemm_time = sum(timed(g, args.steps) for g in gemms)

    buffer_bytes = n * head.num_local * 4
    print(json.dumps({
        "bench": "head", "rank": rank, "world_size": world, "device": paddle.get_device(),
        "margin": args.margin, "num_classes": args.num_classes, "num_local": head.num_local,
        "embedding_size": d, "global_batch": n,
        "step_time_s": round(step_time, 4), "gemm_time_s": round(gemm_time, 4),
        "time_ratio": round(step_time / gemm_time, 3),
        "buffer_bytes": buffer_bytes, "peak_bytes": int(peak), "grad_bytes": int(retained),
        "peak_extra_buffers": round((peak - retained) / buffer_bytes, 3),
        "peak_total_buffers": round(peak / buffer_bytes, 3),
    }), flush=True)


if __name__ == "__main__":
    main()
