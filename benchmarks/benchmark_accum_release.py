"""Partial FC over micro-batches, with and without giving malloc's free pages back before the
head optimizer merges the stashed rows (`SparseRowOptimizer.step`, issue 61): peak RSS, time a
step, the kernel's (system) time a step and minor page faults a step, side by side.

    python benchmarks/benchmark_accum_release.py --classes 200000 --dim 512 --steps 4

One process a variant (VmHWM is per process), run alternately `--repeat` times; each builds the
head and its optimizer as `tools/train.py` does from configs/demo.yaml with the options below
(bfloat16 centres, SGD momentum, `Optimizer.accumulate_steps` micro-batches) and feeds it
random embeddings. "off" replaces `cpu_setup.release_freed_memory` by a no-op in the optimizer
only. The first step (state created) is left out of the times. One JSON line a process.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("PLSC_REPO", ROOT))


def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))


def one(args):
    import numpy as np
    import paddle
    from plsc.config import load_config
    from plsc.nn import PartialFC
    from plsc.optim import sparse_rows
    from plsc.process import cpu_setup
    from plsc.train.builders import build_head_optimizer, build_margin_from_config
    cpu_setup.keep_freed_memory()  # as a run sets malloc
    if args.variant == "off":
        class NoRelease:
            def __getattr__(self, name):
                return (lambda: False) if name == "release_freed_memory" else getattr(cpu_setup, name)
        sparse_rows.cpu_setup = NoRelease()
    cfg = load_config(os.path.join(ROOT, "configs/demo.yaml"), [
        f"Loss.num_classes={args.classes}", f"Loss.sample_ratio={args.ratio}",
        "Loss.param_dtype=bfloat16", f"Optimizer.accumulate_steps={args.micro}",
        f"Model.embedding_size={args.dim}", f"Data.batch_size={args.batch}"])
    loss = cfg["Loss"]
    head = PartialFC(args.dim, args.classes, build_margin_from_config(loss),
                     sample_ratio=args.ratio, param_dtype="bfloat16")
    opt = build_head_optimizer(cfg, 0.1)
    rng = np.random.RandomState(0)
    times, faults, system = [], [], []
    for step in range(args.steps):
        t, u = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        for i in range(args.micro):
            emb = paddle.to_tensor(rng.normal(size=(args.batch, args.dim)).astype("float32"),
                                   stop_gradient=False)
            labels = paddle.to_tensor(rng.randint(0, args.classes, args.batch).astype("int64"))
            head(emb, labels).backward()
            if i + 1 < args.micro:
                opt.stash(head)
        opt.step(head)
        if step:
            times.append(time.perf_counter() - t)
            v = resource.getrusage(resource.RUSAGE_SELF)
            faults.append(v.ru_minflt - u.ru_minflt)
            system.append(round(v.ru_stime - u.ru_stime, 3))
    print(json.dumps({"variant": args.variant, "peak_rss_bytes": hwm(),
                      "step_s": [round(x, 3) for x in times], "system_s": system,
                      "minor_faults": faults}), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--classes", type=int, default=200_000)
    p.add_argument("--ratio", type=float, default=0.3)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--variant", choices=["on", "off"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:
        return one(args)
    rest = [a for a in (argv if argv is not None else sys.argv[1:])]
    for _ in range(args.repeat):
        for variant in ("off", "on"):
            subprocess.run([sys.executable, os.path.abspath(__file__), "--variant", variant] + rest,
                           check=True)


if __name__ == "__main__":
    sys.exit(main())
