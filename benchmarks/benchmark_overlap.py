"""Does summing the backbone's gradients during the backward help? Time of one backbone step
(forward, backward, gradient all-reduce across the ranks) on K gloo ranks spawned here, with
the all-reduces of `OverlappedSum` in each Optimizer.grad_sync mode (after: all after the
backward; backward: started by the parameters' hooks in the backward's thread; thread: the
hooks hand them to a communication thread) and without any all-reduce (compute only),
interleaved step by step (A B C D A B C D) in the same processes; one JSON line from rank 0
with the median step times and the thread mode's median hidden seconds (`OverlappedSum.timing`).

`--why` measures instead why a thread hides nothing on this machine (one JSON line):
`async_call_s` / `async_wait_s`, a 25 MB all-reduce with sync_op=False: time to return, then
in `wait()`; `allreduce_wall_s` / `allreduce_process_cpu_s`, N of them: wall time and this
process's CPU time, all its threads (gloo's own included), user + system; `gil_counts_per_s`,
a Python thread counting while the main thread sleeps, runs the N all-reduces, runs a
backward (a lower rate: the interpreter lock or the cores are held); `thread_allreduce_s`, the
N all-reduces on a thread while the main thread sleeps and while it runs the backward, with
`backward_s` alone and beside them.

    python benchmarks/benchmark_overlap.py --backbone IResNet18 --batch 8 --steps 6
    python benchmarks/benchmark_overlap.py --backbone vit_t_dp005_mask0 --batch 16 --steps 6
    python benchmarks/benchmark_overlap.py --backbone IResNet18 --batch 8 --why
"""
import argparse
import json
import os
import platform
import resource
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import plsc  # noqa: E402,F401  -- before Paddle: sets MKL's dispatch on AMD processors

MODES = ("after", "backward", "thread", "compute_only")


def cpu_name():
    """The CPU's model name and whether it has AVX-512 (from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.processor(), None
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("model name")), "")
    return name, "avx512f" in text


def process_cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def why(args, model, images, dist):
    """The measurements of `--why` (see the module's docstring), as a dict."""
    import paddle
    x = paddle.ones([25 << 18])  # 25 MB of float32
    n = 5

    def reduces():
        for _ in range(n):
            dist.all_reduce(x)
    reduces()
    out = {}
    dist.barrier()
    start = time.perf_counter()
    task = dist.all_reduce(x, sync_op=False)
    called = time.perf_counter()
    task.wait()
    out["async_call_s"], out["async_wait_s"] = called - start, time.perf_counter() - called
    dist.barrier()
    wall, cpu = time.perf_counter(), process_cpu_s()
    reduces()
    out["allreduce_wall_s"] = time.perf_counter() - wall
    out["allreduce_process_cpu_s"] = process_cpu_s() - cpu

    def backward():
        model(images).square().mean().backward()

    def counting_during(fn):
        count, stop = [0], []

        def spin():
            while not stop:
                count[0] += 1
        dist.barrier()
        t = threading.Thread(target=spin)
        start = time.perf_counter()
        t.start()
        fn()
        seconds = time.perf_counter() - start
        stop.append(1)
        t.join()
        return round(count[0] / seconds)
    out["gil_counts_per_s"] = {"main_sleeps": counting_during(lambda: time.sleep(0.5)),
                               "main_allreduces": counting_during(reduces),
                               "main_backward": counting_during(backward)}

    def beside(fn):
        ran = {}

        def comm():
            start = time.perf_counter()
            reduces()
            ran["allreduces"] = time.perf_counter() - start
        dist.barrier()
        t = threading.Thread(target=comm)
        start = time.perf_counter()
        t.start()
        fn()
        ran["main"] = time.perf_counter() - start
        t.join()
        return ran
    backward()
    dist.barrier()
    start = time.perf_counter()
    backward()
    alone = time.perf_counter() - start
    sleeping = beside(lambda: time.sleep(0.6))
    computing = beside(backward)
    out["thread_allreduce_s"] = {"main_sleeps": sleeping["allreduces"],
                                 "main_backward": computing["allreduces"]}
    out["backward_s"] = {"alone": alone, "beside_thread_allreduces": computing["main"]}
    out["allreduces"], out["allreduce_mb"] = n, 25
    return out


def run(args):
    import numpy as np
    import paddle
    import paddle.distributed as dist
    from plsc.process import runtime
    from plsc.models import build_model
    from plsc.train.grad_sync import OverlappedSum

    paddle.set_device("cpu")
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    runtime.set_cpu_threads(args.threads)
    paddle.seed(0)
    model = build_model(args.backbone, embedding_size=512, input_size=(112, 112))
    model.train()
    images = paddle.to_tensor(np.random.RandomState(rank).normal(
        size=(args.batch, 3, 112, 112)).astype("float32"))
    cpu, avx512 = cpu_name()
    common = {"backbone": args.backbone, "ranks": world, "batch_per_rank": args.batch,
              "threads_per_rank": runtime.kernel_threads(), "cpu": cpu, "avx512": avx512,
              "load_avg_1m": os.getloadavg()[0]}
    if args.why:
        out = why(args, model, images, dist)
        if rank == 0:
            print(json.dumps({"benchmark": "overlap_why", **common, **out}), flush=True)
        return
    params = [p for p in model.parameters() if not p.stop_gradient]
    summers = {m: OverlappedSum(params, mode=m, bucket_bytes=args.bucket_mb << 20)
               for m in MODES[:3]}

    def step(mode):
        summer = summers.get(mode)
        dist.barrier()
        start = time.perf_counter()
        if summer is not None:
            summer.arm()
        model(images).square().mean().backward()
        if summer is not None:
            summer.finish()
        seconds = time.perf_counter() - start
        for p in params:
            p.clear_gradient(set_to_zero=False)
        return seconds, summer.timing()["hidden_s"] if summer is not None else 0.0

    for mode in MODES:  # warm-up
        step(mode)
    times = {mode: [] for mode in MODES}
    hidden = []
    for _ in range(args.steps):
        for mode in MODES:
            seconds, h = step(mode)
            times[mode].append(seconds)
            if mode == "thread":
                hidden.append(h)
    if rank == 0:
        median = {m: float(np.median(t)) for m, t in times.items()}
        print(json.dumps({
            "benchmark": "overlap", **common,
            "gradient_mb": round(sum(p.size for p in params) * 4 / 2 ** 20, 1),
            "buckets": len(summers["after"].buckets), "bucket_mb": args.bucket_mb,
            "steps": args.steps,
            **{f"median_s_{m}": round(v, 4) for m, v in median.items()},
            "median_hidden_s_thread": round(float(np.median(hidden)), 4),
            **{f"{m}_over_after": round(median[m] / median["after"], 3)
               for m in ("backward", "thread", "compute_only")},
        }), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backbone", default="IResNet18")
    p.add_argument("--batch", type=int, default=8, help="images per rank")
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--bucket-mb", type=int, default=25, help="OverlappedSum's bucket size")
    p.add_argument("--why", action="store_true", help="measure why a thread hides nothing")
    args = p.parse_args()
    import paddle.distributed as dist
    dist.spawn(run, args=(args,), nprocs=args.ranks)


if __name__ == "__main__":
    main()
