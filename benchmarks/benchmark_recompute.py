"""Step time and peak memory of a backbone training step with and without `Model.recompute`;
one JSON line.

    python benchmarks/benchmark_recompute.py --backbone IResNet50 --batch 32
    python benchmarks/benchmark_recompute.py --backbone vit_t --batch 32 --steps 3

Each setting runs in its own process (so each has its own peak): build the backbone, one
warm-up step, then `--steps` timed steps of forward, backward and an SGD-momentum update on
random images; the loss is the squared norm of the embeddings. Memory, two ways:
`step_alloc_peak_bytes`, the peak of Paddle's host allocator during the timed steps above what
is allocated between steps (parameters, momentum, the batch): the activations kept for the
backward, the temporaries and the gradients (as large as the parameters, `param_bytes`, in
both runs); and the process's peak resident set (VmHWM), with `step_rss_peak_bytes` = that
peak minus the resident set before the first step (this one also counts the momentum, and
memory that malloc keeps after Paddle frees it). Both runs start from the same
seed and batch, and the JSON says whether their first losses agree bit for bit. Recompute buys
memory with a second forward of every block.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import plsc  # noqa: F401  -- before Paddle: sets MKL's dispatch on AMD processors


def _rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child(args):
    import hashlib

    import numpy as np
    import paddle

    from paddle.base import core

    from plsc.process import runtime
    from plsc.models import build_model
    runtime.set_cpu_threads(args.threads)
    runtime.keep_freed_memory()
    paddle.seed(0)
    model = build_model(args.backbone, embedding_size=512, input_size=(args.size, args.size),
                        recompute=args.recompute)
    model.train()
    opt = paddle.optimizer.Momentum(0.01, momentum=0.9, parameters=model.parameters())
    images = paddle.to_tensor(np.random.RandomState(0).standard_normal(
        (args.batch, 3, args.size, args.size)).astype("float32"))
    digest = hashlib.sha256()

    def step(record):
        emb = model(images)
        loss = (emb * emb).sum()
        loss.backward()
        if record:
            digest.update(np.float32(loss.item()).tobytes())
        opt.step()
        opt.clear_grad(set_to_zero=False)

    before = _rss("VmRSS")
    step(True)  # warm-up; its loss is compared between the runs
    allocated = core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step(False)
        times.append(time.perf_counter() - start)
    peak = _rss("VmHWM")
    alloc_peak = core.host_memory_stat_peak_value("Allocated", 0) - allocated
    params = sum(int(np.prod(p.shape)) * 4 for p in model.parameters())
    print(json.dumps({"recompute": args.recompute, "param_bytes": params, "step_seconds_min": round(min(times), 3),
                      "step_seconds_median": round(sorted(times)[len(times) // 2], 3),
                      "step_alloc_peak_bytes": alloc_peak, "peak_rss_bytes": peak,
                      "rss_before_steps_bytes": before, "step_rss_peak_bytes": peak - before, "first_loss_sha256": digest.hexdigest()}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backbone", default="IResNet50")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=112, help="image height and width")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: plsc's)")
    p.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    runs = {}
    for flag in (False, True):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--backbone", args.backbone,
               "--batch", str(args.batch), "--size", str(args.size), "--steps", str(args.steps)]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        cmd += ["--recompute"] if flag else []
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs["recompute" if flag else "plain"] = json.loads(out.strip().splitlines()[-1])
    plain, rc = runs["plain"], runs["recompute"]
    print(json.dumps({"backbone": args.backbone, "batch": args.batch, "size": args.size,
                      "steps": args.steps, "plain": plain, "recompute": rc,
                      "same_first_loss": plain["first_loss_sha256"] == rc["first_loss_sha256"],
                      "step_alloc_peak_ratio": round(rc["step_alloc_peak_bytes"]
                                                     / plain["step_alloc_peak_bytes"], 3),
                      "step_rss_peak_ratio": round(rc["step_rss_peak_bytes"]
                                                   / plain["step_rss_peak_bytes"], 3),
                      "step_time_ratio": round(rc["step_seconds_median"]
                                               / plain["step_seconds_median"], 3)}))


if __name__ == "__main__":
    main()
