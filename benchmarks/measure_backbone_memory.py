"""Memory of a backbone's training step (and of an evaluation forward) per sample, measured on
this machine: the rows of `plsc.train.plan.measured.BACKBONES`.

    python benchmarks/measure_backbone_memory.py --backbone IResNetTiny --image-size 56 \
        --batch 32 64 128 256 --eval-batch 100 200

Each (mode, batch) runs in a process of its own (one kernel thread, as a rank of a 2-rank run
on 2 cores, malloc keeping freed blocks as in a run and giving them back after each training
step as the trainer does after its first steps; `--no-release` keeps them): the backbone and
its optimizer are built, a uint8 batch is made, then the steps run (forward, backward, the
optimizer's step; the loss is the embeddings' sum, no head). Reported per process: the peak resident set (VmHWM) above
the resident set before the first step, less the gradients and the optimizer state the first
step creates (computed from the parameters' shapes), and the same for Paddle's host allocator
(its peak above what was allocated before the step). The JSON line at the end gives them per
batch size: {batch: bytes}, the planner interpolating between them (the resident set is not
linear in the batch: malloc keeps freed blocks below 1 GiB and returns larger ones).
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def child(args):
    import numpy as np
    from plsc.process import cpu_setup
    cpu_setup.apply(1)
    cpu_setup.keep_freed_memory()
    import paddle
    from paddle.base import core
    from plsc.models import build_model
    h, w = args.image_size
    kwargs = {"recompute": True} if args.recompute else {}
    model = build_model(args.backbone, embedding_size=args.embedding_size, input_size=(h, w),
                        **kwargs)
    params = [p for p in model.parameters() if not p.stop_gradient]
    n = sum(int(p.size) for p in params)
    if args.optimizer == "sgd":
        opt = paddle.optimizer.Momentum(0.01, momentum=0.9, parameters=params)
        state = 4 * n
    else:
        opt = paddle.optimizer.AdamW(0.001, parameters=params)
        state = 8 * n
    rng = np.random.RandomState(0)
    raw = paddle.to_tensor(rng.randint(0, 255, (args.batch, h, w, 3)).astype(np.uint8))
    if args.mode == "train":
        model.train()
    else:
        model.eval()
        state = 0
    before, allocated = _status("VmRSS"), core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    for _ in range(args.steps):
        x = (raw.astype("float32").transpose([0, 3, 1, 2]) - 127.5) / 127.5
        if args.mode == "train":
            model(x).sum().backward()
            opt.step()
            opt.clear_grad(set_to_zero=False)
            if args.release:  # as the trainer does after each of its first steps
                cpu_setup.release_freed_memory()
        else:
            with paddle.no_grad():
                model(x)
    grads = 4 * n if args.mode == "train" else 0
    print(json.dumps({"rss_bytes": _status("VmHWM") - before - grads - state,
                      "alloc_bytes": core.host_memory_stat_peak_value("Allocated", 0) - allocated
                      - grads - state, "params": n}))


def _run(args, mode, batch):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode, "--batch",
           str(batch), "--backbone", args.backbone, "--image-size", *map(str, args.image_size),
           "--optimizer", args.optimizer, "--steps", str(args.steps),
           "--embedding-size", str(args.embedding_size)] + (["--recompute"] if args.recompute else [])
    cmd += [] if args.release else ["--no-release"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _points(args, mode, batches):
    runs = [_run(args, mode, b) for b in batches]
    out = {f"{mode}_{key}": {b: r[f"{key}_bytes"] for b, r in zip(batches, runs)}
           for key in ("rss", "alloc")}
    return out, runs[0]["params"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backbone", required=True)
    p.add_argument("--image-size", type=int, nargs=2, default=[112, 112])
    p.add_argument("--embedding-size", type=int, default=512)
    p.add_argument("--batch", type=int, nargs="+", default=[8, 16])
    p.add_argument("--eval-batch", type=int, nargs="*", default=[])
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-release", dest="release", action="store_false",
                   help="keep malloc's freed blocks between steps (the trainer gives them back "
                        "after each of its first steps: cpu_setup.release_freed_memory)")
    p.add_argument("--child", action="store_true")
    p.add_argument("--mode", choices=("train", "eval"), default="train")
    args = p.parse_args(argv)
    if args.child:
        args.batch = args.batch[0]
        return child(args)
    row, params = _points(args, "train", args.batch)
    if args.eval_batch:
        row.update(_points(args, "eval", args.eval_batch)[0])
    print(json.dumps({"backbone": args.backbone, "image_size": args.image_size,
                      "recompute": args.recompute, "params": params, "batches": args.batch,
                      "eval_batches": args.eval_batch, **row}))


if __name__ == "__main__":
    sys.exit(main())
