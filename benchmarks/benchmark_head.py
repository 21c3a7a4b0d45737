"""Benchmark a step of the PartialFC head; one JSON line per rank and sample ratio.

    python -m paddle.distributed.launch --nproc_per_node 2 benchmarks/benchmark_head.py \
        --num-classes 200000 --embedding-size 512 --batch-size 128
    python -m paddle.distributed.launch --nproc_per_node 2 benchmarks/benchmark_head.py \
        --num-classes 1000000 --sample-ratio 1.0 0.3 0.1 --update
    python -m paddle.distributed.launch --nproc_per_node 2 benchmarks/benchmark_head.py \
        --num-classes 400000 --batch-size 256 --chunk-size 0 25000
    python benchmarks/benchmark_head.py --num-classes 12500000 --embedding-size 128 \
        --batch-size 256 --sample-ratio 0.1 --compare-dense
    python -m paddle.distributed.launch --nproc_per_node 2 benchmarks/benchmark_head.py \
        --num-classes 400000 --batch-size 256 --chunk-size 25000 --update \
        --param-dtype float32 bfloat16 --fused
    python benchmarks/benchmark_head.py --num-classes 200000 --batch-size 512 \
        --param-dtype int8 --fused --compare-dtypes --compare-state-dtypes int8 int4 \
        --sample-ratio 1.0 0.1 --steps 7
    python -m paddle.distributed.launch --nproc_per_node 2 benchmarks/benchmark_head.py \
        --capacity --num-classes 9000000 --batch-size 256 --chunk-size 16384 \
        --param-dtype bfloat16 --fused --save /tmp/plsc_capacity

A step is forward + backward (+ the head's SparseMomentum update with
`--update`, SparseAdamW with `--optimizer adamw`; with `--fused` the update happens inside the
backward, float32 runs excepted when `--fused-fp32` is not given). `--param-dtype` stores the
centres and the optimizer state in that dtype (float32, bfloat16, float16 or int8; each value
measured in turn); `--state-dtype` stores the state in another (e.g. int4). Measured in the
same run: the step time, the time of the head's
three GEMMs alone on the same shapes (logits, embedding gradient, weight
gradient, dense shapes; with sampling, on the sampled rows; each repeated back to
back, medians added): `gemm_time_s` with fresh outputs, as any op allocates them,
`gemm_compute_s` into outputs allocated once (the arithmetic alone);
`group_time_ratio` divides the step by the slowest rank's `gemm_time_s` (the ranks' steps
wait for each other, so the slowest rank's GEMMs bound the group); with sampling the time of
the draw alone (`sample_time_s`) and, with
`--compare-dense`, the step of a head of exactly the sampled number of classes without
sampling (`dense_ratio` = step / that step), and the peak memory the step
allocates over what existed before it (weights, optimizer state; the head's
workspace, kept between steps, counts as the step's and is also given alone), in units of
one `[N, num_local]` float32 buffer (N = global batch). `peak_extra_buffers`
leaves out the gradients the step returns (they outlive it and any head needs
them); `peak_total_buffers` counts everything allocated during the step.
"""
import argparse
import json
import os
import statistics
import time

import plsc  # noqa: F401  -- before Paddle: MKL's dispatch on AMD processors
import numpy as np
import paddle
from paddle.base import core

import plsc.distributed as pd
from plsc.process import runtime
from plsc.loss import MARGINS
from plsc.nn import PartialFC
from plsc.nn.sampling import sample_centres
from plsc.optim import SparseAdamW, SparseMomentum
from plsc.storage import name as storage_name


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
    p.add_argument("--sub-centers", type=int, default=1,
                   help="centres per class (the GEMM bound then covers all K·C rows; default 1)")
    p.add_argument("--sample-ratio", type=float, nargs="+", default=[1.0],
                   help="Partial FC ratio(s), each measured in turn (default 1.0)")
    p.add_argument("--chunk-size", type=int, nargs="+", default=[0],
                   help="classes per block of the logit-free head, each measured in turn "
                        "(0: dense; default 0)")
    p.add_argument("--update", action="store_true",
                   help="include the head's optimizer update (SparseMomentum) in the step")
    p.add_argument("--param-dtype", nargs="+", default=["float32"],
                   choices=("float32", "bfloat16", "float16", "int8"),
                   help="storage of the class centres and their optimizer state, each measured in "
                        "turn (default float32)")
    p.add_argument("--state-dtype", choices=("float32", "bfloat16", "float16", "int8", "int4"),
                   help="storage of the optimizer state (default: the centres')")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                   help="the head's optimizer with --update, --fused and --capacity: "
                        "SparseMomentum (default) or SparseAdamW")
    p.add_argument("--fused", action="store_true",
                   help="16-bit runs update the head inside its backward (implies --update)")
    p.add_argument("--fused-fp32", action="store_true",
                   help="float32 runs too update inside the backward (with --fused)")
    p.add_argument("--compare-dtypes", action="store_true",
                   help="time the steps of every --param-dtype and the GEMMs in the same rounds "
                        "and report their ratios (one JSON line per rank)")
    p.add_argument("--compare-state-dtypes", nargs="+",
                   choices=("float32", "bfloat16", "float16", "int8", "int4"),
                   help="with --compare-dtypes: every --param-dtype with each of these state "
                        "dtypes, in the same rounds (e.g. int8 int4: 4-bit against 8-bit state)")
    p.add_argument("--save", metavar="DIR",
                   help="capacity mode: also save the head's arrays (streamed, as a checkpoint "
                        "does) into DIR, and report the time and the peak RSS with it")
    p.add_argument("--compare-dense", action="store_true",
                   help="also time a head of exactly the sampled number of classes without "
                        "sampling (dense_step_time_s, dense_ratio)")
    p.add_argument("--steps", type=int, default=3,
                   help="timed rounds (each runs the step and every reference once), medians "
                        "reported (default 3)")
    p.add_argument("--capacity", action="store_true",
                   help="only run one step (forward, backward, SparseMomentum update) and report "
                        "its memory: for finding the largest class count that fits")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _fused(args, dtype):
    return args.fused and (dtype != "float32" or args.fused_fp32)


def _optimizer(args, state=None):
    state = state or args.state_dtype
    if args.optimizer == "adamw":
        return SparseAdamW(0.001, weight_decay=0.05, state_dtype=state)
    return SparseMomentum(0.1, momentum=0.9, weight_decay=5e-4, state_dtype=state)


def local_batch(args, rank):
    """(rng, embeddings `[batch, d]` that want a gradient, labels `[batch]`) of this rank."""
    rng = np.random.RandomState(args.seed + rank)
    x = paddle.to_tensor(rng.normal(size=(args.batch_size, args.embedding_size)).astype("float32"))
    x.stop_gradient = False
    y = paddle.to_tensor(rng.randint(0, args.num_classes, args.batch_size).astype("int64"))
    return rng, x, y


def make_step(head, opt, x, y, fused):
    """forward + backward (+ the update: separate, or inside the backward when `fused`)."""
    def step():
        if fused:
            head.row_update = opt.fused_update(head)
        head(x, y).backward()
        head.row_update = None
        if fused:
            opt.end_fused_step(head)
        elif opt is not None:
            opt.step(head)
    return step


def bench_ratio(args, ratio, rank, world, chunk, dtype):
    d, b = args.embedding_size, args.batch_size
    n = b * world
    head = PartialFC(d, args.num_classes, MARGINS[args.margin](), sample_ratio=ratio,
                     seed=args.seed, chunk_size=chunk, param_dtype=dtype,
                     sub_centers=args.sub_centers)
    fused = _fused(args, dtype)
    opt = _optimizer(args) if args.update or args.fused else None
    rng, x, y = local_batch(args, rank)
    step = make_step(head, opt, x, y, fused)

    def clear():  # free (not zero) the gradients, so each step allocates its own
        x.grad = None
        head.drop_dense_gradients()
        head.release_sampled_rows()

    step()  # warm-up; creates the optimizer state
    clear()
    meter = MemoryMeter()
    base = meter.current()
    meter.reset_peak()
    step()
    sync()
    # The head's workspace (buffers kept between steps, see plsc.nn.workspace) belongs to the
    # step: it exists before the measured step only because the warm-up step made it.
    workspace = head.workspace.nbytes
    peak = meter.peak() - base + workspace
    retained = meter.current() - base
    clear()
    # The step (and the dense head, and the draw) timed in rounds, each round running every
    # one once, so that a drift of the machine's speed hits all alike; medians reported.
    runs = {"step": lambda: (clear(), step())}
    if ratio < 1.0:  # the draw alone, on this step's labels
        target = head.partition.shard_labels(pd.gather_concat(y), rank)
        runs["sample"] = lambda: sample_centres(target, head.num_local, ratio, args.seed, 0, rank)
    if args.compare_dense:  # a head of exactly the sampled number of classes, no sampling
        dense = PartialFC(d, head.num_sample * world, MARGINS[args.margin](), chunk_size=chunk)
        dense_y = paddle.to_tensor(rng.randint(0, head.num_sample * world, b).astype("int64"))

        def dense_step():
            x.grad = None
            dense.weight.grad = None
            dense(x, dense_y).backward()
        dense_step()
        runs["dense_step"] = dense_step
    times = {key: [] for key in runs}
    for _ in range(args.steps):
        for key, fn in runs.items():
            times[key].append(timed(fn, 1))
    t = {key: statistics.median(v) for key, v in times.items()}
    step_time = t["step"]
    if args.compare_dense:
        del dense
    del runs

    # The three GEMMs alone, same shapes (logits, dx, dW), each repeated back to back, after
    # the step's rounds (their operands alive during the step slow it down here): with fresh
    # outputs (as any op allocates them), and into outputs allocated once (the arithmetic
    # alone, without the first touch of fresh memory).
    feats = paddle.randn([n, d])
    w = paddle.randn([head.num_sample * head.sub_centers, d])
    logits = paddle.matmul(feats, w, transpose_y=True)
    outs = [paddle.ones_like(logits), paddle.ones_like(feats), paddle.ones_like(w)]
    gemms = [(lambda o: paddle.matmul(feats, w, transpose_y=True, out=o)),
             (lambda o: paddle.matmul(logits, w, out=o)),
             (lambda o: paddle.matmul(logits, feats, transpose_x=True, out=o))]
    gemm_time = sum(timed(lambda: g(None), args.steps) for g in gemms)
    gemm_compute = sum(timed(lambda: g(o), args.steps) for g, o in zip(gemms, outs))
    del feats, w, logits, outs
    # The ranks' steps wait for each other in the collectives, so the group's step is bound
    # by its slowest rank's GEMMs.
    slowest = paddle.to_tensor([gemm_time], dtype="float32")
    if world > 1:
        pd.all_reduce_(slowest, "max")
    group_gemm_time = float(slowest[0])

    extra = {}
    if "sample" in t:
        extra["sample_time_s"] = round(t["sample"], 4)
    if "dense_step" in t:
        extra.update(dense_step_time_s=round(t["dense_step"], 4),
                     dense_ratio=round(step_time / t["dense_step"], 3))

    buffer_bytes = n * head.num_local * head.sub_centers * 4
    return {**extra,
        "bench": "head", "rank": rank, "world_size": world, "device": paddle.get_device(),
        "cpu_threads": runtime.kernel_threads(),
        "margin": args.margin, "sub_centers": args.sub_centers, "num_classes": args.num_classes,
        "num_local": head.num_local,
        "embedding_size": d, "global_batch": n, "sample_ratio": ratio, "chunk_size": chunk,
        "num_sample": head.num_sample, "update": opt is not None, "param_dtype": dtype,
        "fused": fused,
        "step_time_s": round(step_time, 4), "gemm_time_s": round(gemm_time, 4),
        "time_ratio": round(step_time / gemm_time, 3),
        "group_gemm_time_s": round(group_gemm_time, 4),
        "group_time_ratio": round(step_time / group_gemm_time, 3),
        "gemm_compute_s": round(gemm_compute, 4),
        "compute_ratio": round(step_time / gemm_compute, 3),
        "buffer_bytes": buffer_bytes, "peak_bytes": int(peak), "grad_bytes": int(retained),
        "workspace_bytes": int(workspace),
        "peak_extra_buffers": round((peak - retained) / buffer_bytes, 3),
        "peak_total_buffers": round(peak / buffer_bytes, 3),
    }


def bench_dtypes(args, ratio, rank, world, chunk):
    """The step of one head per `--param-dtype` (and, with `--compare-state-dtypes`, per state
    dtype: keys "int8+int4") and the three GEMMs (fresh outputs), all in the same rounds (each
    round runs every one once, medians reported), so that the ratios are measured under the
    same machine conditions."""
    d, b = args.embedding_size, args.batch_size
    n = b * world
    rng, x, y = local_batch(args, rank)
    states = args.compare_state_dtypes or [None]
    runs = {}
    for dtype in args.param_dtype:
        for state in states:
            head = PartialFC(d, args.num_classes, MARGINS[args.margin](), sample_ratio=ratio,
                             seed=args.seed, chunk_size=chunk, param_dtype=dtype)
            opt = _optimizer(args, state) if args.update or args.fused else None
            step = make_step(head, opt, x, y, _fused(args, dtype))

            def run(step=step, head=head):
                x.grad = None
                head.drop_dense_gradients()
                step()
            run()  # warm-up; creates the optimizer state
            runs[dtype if state is None else f"{dtype}+{state}"] = run
    keys = list(runs)
    feats = paddle.randn([n, d])
    w = paddle.randn([head.num_sample, d])  # the GEMMs on the (last) head's shapes
    logits = paddle.matmul(feats, w, transpose_y=True)
    runs["gemms"] = lambda: (paddle.matmul(feats, w, transpose_y=True),
                             paddle.matmul(logits, w), paddle.matmul(logits, feats, transpose_x=True))
    times = {key: [] for key in runs}
    for _ in range(args.steps):
        for key, fn in runs.items():
            times[key].append(timed(fn, 1))
    t = {key: statistics.median(v) for key, v in times.items()}
    return {"bench": "dtypes", "rank": rank, "world_size": world, "num_classes": args.num_classes,
            "embedding_size": d, "global_batch": n, "sample_ratio": ratio, "chunk_size": chunk,
            "optimizer": args.optimizer,
            "update": bool(args.update or args.fused), "fused": {k: _fused(args, k) for k in
                                                                  args.param_dtype},
            "step_time_s": {k: round(t[k], 4) for k in keys},
            "gemm_time_s": round(t["gemms"], 4),
            "time_ratio": {k: round(t[k] / t["gemms"], 3) for k in keys},
            f"ratio_to_{keys[0]}": {k: round(t[k] / t[keys[0]], 3) for k in keys},
            "pair_ratios": {k: [round(a / b, 3) for a, b in zip(times[k], times[keys[0]])]
                            for k in keys[1:]}}


def rss_peak_bytes():
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith("VmHWM")).split()[1])


def capacity(args, ratio, rank, world, chunk, dtype):
    """Two full training steps of the head at this size, and its memory per class:
    `init` = building the head, `step` = the second step's forward, backward and
    update (the optimizer state exists by then), `state` = what stays between steps;
    with `--save`, then a save of the head's arrays as a checkpoint writes them."""
    d, b = args.embedding_size, args.batch_size
    meter = MemoryMeter()
    meter.reset_peak()
    start = time.perf_counter()
    head = PartialFC(d, args.num_classes, MARGINS[args.margin](), sample_ratio=ratio,
                     seed=args.seed, chunk_size=chunk, param_dtype=dtype)
    init_peak = meter.peak()
    opt = _optimizer(args)
    rng, x, y = local_batch(args, rank)
    fused = _fused(args, dtype)
    step = make_step(head, opt, x, y, fused)
    step()  # creates the optimizer state
    sync()
    meter.reset_peak()
    t0 = time.perf_counter()
    step()
    sync()
    step_seconds = time.perf_counter() - t0
    step_peak, state = meter.peak(), meter.current()
    per = head.num_local
    workspace = head.workspace.nbytes  # kept between steps (counted in `state`)
    out = {"bench": "capacity", "rank": rank, "world_size": world,
           "num_classes": args.num_classes, "num_local": per, "global_batch": b * world,
           "embedding_size": d, "sample_ratio": ratio, "chunk_size": chunk,
           "param_dtype": dtype, "optimizer": args.optimizer,
           "state_dtypes": {k: storage_name(v) for k, v in opt.state_dict().items()
                            if k != "step_count"}, "fused": fused, "completed": True,
           "step_seconds": round(step_seconds, 1),
           "init_peak_bytes_per_class": round(init_peak / per, 1),
           "step_peak_bytes_per_class": round(step_peak / per, 1),
           "state_bytes_per_class": round(state / per, 1),
           "workspace_bytes_per_class": round(workspace / per, 1),
           "rss_peak_after_steps_bytes": rss_peak_bytes()}
    if args.save:
        from plsc.checkpoint import save_rows_npy
        folder = os.path.join(args.save, f"head_rank{rank}")
        os.makedirs(folder, exist_ok=True)
        meter.reset_peak()
        t0 = time.perf_counter()
        arrays = {"weight": head.weight, **{f"opt.{k}": v for k, v in opt.state_dict().items()
                                            if v.ndim > 0}}
        for name, array in arrays.items():
            save_rows_npy(os.path.join(folder, f"{name}.npy"), array)
        out.update(save_seconds=round(time.perf_counter() - t0, 1),
                   save_peak_bytes_per_class=round(meter.peak() / per, 1),
                   saved_bytes=sum(os.path.getsize(os.path.join(folder, f))
                                   for f in os.listdir(folder)))
    out.update(seconds=round(time.perf_counter() - start, 1), rss_peak_bytes=rss_peak_bytes())
    return out


def main(argv=None):
    args = parse_args(argv)
    for r in args.sample_ratio:
        if not 0.0 < r <= 1.0:
            raise SystemExit(f"--sample-ratio values must be in (0, 1], got {r}")
    pd.init()
    if paddle.get_device() == "cpu":  # as a training run sets up the CPU (plsc.process.runtime)
        runtime.keep_freed_memory()
        runtime.set_cpu_threads()
    rank, world = pd.get_rank(), pd.get_world_size()
    paddle.seed(args.seed + rank)
    run = capacity if args.capacity else bench_ratio
    for ratio in args.sample_ratio:
        for chunk in args.chunk_size:
            if args.compare_dtypes:
                print(json.dumps(bench_dtypes(args, ratio, rank, world, chunk)), flush=True)
                continue
            for dtype in args.param_dtype:
                print(json.dumps(run(args, ratio, rank, world, chunk, dtype)), flush=True)


if __name__ == "__main__":
    main()
