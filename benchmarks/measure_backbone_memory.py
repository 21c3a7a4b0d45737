"""Memory of a backbone's training step (and of an evaluation forward) per sample, measured on
this machine: the rows of `plsc.train.plan.measured.BACKBONES`.

    python benchmarks/measure_backbone_memory.py --backbone IResNetTiny --image-size 56 56 \
        --batch 32 64 128 256 --eval-batch 100 200
    python benchmarks/measure_backbone_memory.py --write-table [--only NAME...]

The second measures every entry of `TABLE` (every backbone plsc ships) and writes the planner's
table, plsc/train/plan/measured_table.json (`--only`: those backbones' entries again, the other
rows kept; `--match=TEXT`: the entries whose arguments contain TEXT; `--train-only`,
`--act-only`, `--eval-only`: only those points of the rows, the others kept).

Each (mode, batch) runs in a process of its own (one kernel thread, as a rank of a 2-rank run
on 2 cores, malloc keeping freed blocks as in a run and giving them back after each training
step as the trainer does after its first steps; `--no-release` keeps them): the backbone and
its optimizer are built, a uint8 batch is made, then a warm-up step runs (forward, backward,
the optimizer's step; the loss is the embeddings' sum, no head), which creates the optimizer's
state and the kernels' caches, and then `--steps` measured steps, the peaks reset just before them
(`/proc/self/clear_refs`; the warm-up's own peak is the state created beside the gradients,
not the activations: ViT-L's at batch 4). Reported per process: the measured steps' peak resident
set (VmHWM) above the resident set before the warm-up, less the gradients and the optimizer
state (computed from the parameters' shapes; what the warm-up leaves besides, the kernels'
caches, is counted), and the same for Paddle's host allocator (its peak above what was
allocated before the warm-up). The JSON line at the end gives them per
batch size: {batch: bytes}, the planner interpolating between them (the resident set is not
linear in the batch: malloc keeps freed blocks below 1 GiB and returns larger ones).

Each batch is measured twice, in processes of their own: as the trainer runs (`train_rss`,
`train_alloc`: the gradients freed after each step, so where the activations are smaller than
the gradients the step peaks once every gradient exists, and the figure is what the step holds
beside them, a floor, not activations) and with the gradients kept allocated (zeroed) from the
warm-up on (`act_rss`, `act_alloc`; `--keep-gradients` alone: the step's peak above them is its
activations, whatever the gradients' size). The planner combines the two as the trainer frees
the gradients (`plsc.train.plan.model.step_beyond_gradients`).

An evaluation point runs what the trainer runs: malloc's kept blocks given back, then the
evaluator's `plsc.embedding.embed` of random float32 images and their flips (`--eval-steps`
forwards of the batch), the peak reset (`/proc/self/clear_refs`) just before; the median of at
least `--eval-repeats` processes.
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
    from plsc.models import model_options
    # recompute as asked, also off for a backbone whose name recomputes (ViT-B, -L, -H)
    kwargs = {"recompute": args.recompute} if "recompute" in model_options(args.backbone) else {}
    if args.recompute and not kwargs:
        raise SystemExit(f"{args.backbone} has no recompute option")
    model = build_model(args.backbone, embedding_size=args.embedding_size, input_size=(h, w),
                        **kwargs)
    if args.mode == "eval":
        return _eval_child(args, model)
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
    model.train()

    def step():
        x = (raw.astype("float32").transpose([0, 3, 1, 2]) - 127.5) / 127.5
        model(x).sum().backward()
        opt.step()
        opt.clear_grad(set_to_zero=args.keep_gradients)  # freed, as the trainer does
        if args.release:  # as the trainer does after each of its first steps
            cpu_setup.release_freed_memory()
    before, allocated = _status("VmRSS"), core.host_memory_stat_current_value("Allocated", 0)
    step()  # the warm-up: the optimizer's state created, the kernels' caches made
    _reset_peaks(core)  # its peak (the state created beside the gradients) is not the step's
    for _ in range(args.steps):
        step()
    grads = 4 * n
    print(json.dumps({"rss_bytes": _status("VmHWM") - before - grads - state,
                      "alloc_bytes": core.host_memory_stat_peak_value("Allocated", 0) - allocated
                      - grads - state, "params": n}))


def _eval_child(args, model):
    """An evaluation as the trainer runs one: malloc's kept blocks given back first, then the
    evaluator's own `embed` of a pack's images and their flips (`--eval-steps` forwards of
    `--batch`); the images themselves (a planner term of their own) exist before."""
    import numpy as np
    from paddle.base import core
    from plsc.embedding import embed
    from plsc.process import cpu_setup
    images = np.random.RandomState(0).uniform(
        -1, 1, (max(1, args.steps * args.batch // 2), 3, *args.image_size)).astype(np.float32)
    cpu_setup.release_freed_memory()
    before, allocated = _status("VmRSS"), core.host_memory_stat_current_value("Allocated", 0)
    _reset_peaks(core)
    embed(model, images, args.batch, flip=True)
    print(json.dumps({"rss_bytes": _status("VmHWM") - before,
                      "alloc_bytes": core.host_memory_stat_peak_value("Allocated", 0) - allocated,
                      "params": sum(int(p.size) for p in model.parameters() if not p.stop_gradient)}))


def _reset_peaks(core):
    """The process's peak resident set (VmHWM := VmRSS, `/proc/self/clear_refs`) and Paddle's
    allocator peak start again from now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    core.host_memory_stat_reset_peak_value("Allocated", 0)


def _run(args, mode, batch):
    """One child process's figures; `mode` "act": a training step with the gradients kept."""
    steps = args.eval_steps if mode == "eval" else args.steps
    keep = args.keep_gradients or mode == "act"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mode",
           "eval" if mode == "eval" else "train", "--batch",
           str(batch), "--backbone", args.backbone, "--image-size", *map(str, args.image_size),
           "--optimizer", args.optimizer, "--steps", str(steps),
           "--embedding-size", str(args.embedding_size)] + (["--recompute"] if args.recompute else [])
    cmd += ([] if args.release else ["--no-release"]) + (["--keep-gradients"] if keep else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _median_run(args, mode, batch):
    """The run whose resident set is the median of `args.repeats` processes (where malloc
    places the batches moves it by up to a quarter; an evaluation's, by up to 2x: at least
    `args.eval_repeats`)."""
    repeats = max(args.repeats, args.eval_repeats) if mode == "eval" else args.repeats
    runs = sorted((_run(args, mode, batch) for _ in range(repeats)),
                  key=lambda r: r["rss_bytes"])
    return runs[len(runs) // 2]


def _points(args, mode, batches):
    runs = [_median_run(args, mode, b) for b in batches]
    out = {f"{mode}_{key}": {b: r[f"{key}_bytes"] for b, r in zip(batches, runs)}
           for key in ("rss", "alloc")}
    return out, runs[0]["params"]


def measure(args):
    """The row of `args`: {"train_rss", "train_alloc", "act_rss", "act_alloc"[, "eval_rss",
    "eval_alloc"]: {batch: bytes}} and the trainable parameter count."""
    row, params = _points(args, "train", args.batch)
    if not args.keep_gradients:  # else the training points are these already
        row.update(_points(args, "act", args.batch)[0])
    if args.eval_batch:
        row.update(_points(args, "eval", args.eval_batch)[0])
    return row, params


# The planner's table: every backbone plsc ships, with and without recompute where it has the
# option; the large ones at a small batch (and ViT-H, IResNet200 at 56 x 56: the planner scales
# by the pixels, a rule the "check" rows measure at a second size, IResNet100's and ViT-L's; and
# it extends the line through the two smallest batches, which ViT-L's third batch at 56 x 56
# checks). Each entry: the arguments of this script that measure it.
TABLE = [
    "--backbone IResNetTiny --image-size 56 56 --embedding-size 128 --batch 32 64 128 256 "
    "--eval-batch 100 200 --repeats 3",
    "--backbone IResNetTiny --image-size 56 56 --embedding-size 128 --batch 32 64 --recompute",
    "--backbone ViTDemo --image-size 56 56 --embedding-size 128 --optimizer adamw --batch 32 64 "
    "--eval-batch 100 200 --repeats 3",
    "--backbone ViTDemo --image-size 56 56 --embedding-size 128 --optimizer adamw --batch 32 64 "
    "--recompute",
    "--backbone ViT_T --image-size 56 56 --optimizer adamw --batch 32 64 --eval-batch 100 200 "
    "--repeats 3",
    "--backbone ViT_T --optimizer adamw --batch 16 32",
    "--backbone ViT_T --optimizer adamw --batch 16 32 --recompute",
    "--backbone ViT_S --optimizer adamw --batch 8 16",
    "--backbone ViT_S --optimizer adamw --batch 8 16 --recompute",
    "--backbone ViT_B --optimizer adamw --batch 4 8",
    "--backbone ViT_B --optimizer adamw --batch 4 8 --recompute",
    "--backbone ViT_L_DP005_Mask005 --optimizer adamw --batch 4 8 --recompute",
    "--backbone ViT_L_DP005_Mask005 --optimizer adamw --batch 4 8",
    "--backbone ViT_L_DP005_Mask005 --image-size 56 56 --optimizer adamw --batch 4 8 16 "
    "--recompute",
    "--backbone ViT_L_DP005_Mask005 --image-size 56 56 --optimizer adamw --batch 4 8 16 32",
    "--backbone MobileFaceNet --batch 16 32",
    "--backbone MobileFaceNetLarge --batch 16 32",
    "--backbone IResNet18 --batch 16 32 --eval-batch 64 128",
    "--backbone IResNet18 --batch 16 32 --recompute",
    "--backbone IResNet34 --batch 8 16",
    "--backbone IResNet34 --batch 8 16 --recompute",
    "--backbone IResNet50 --batch 8 16",
    "--backbone IResNet50 --batch 8 16 --recompute",
    "--backbone IResNet100 --batch 8 16",
    "--backbone IResNet100 --batch 8 16 --recompute",
    "--backbone IResNet100 --image-size 56 56 --batch 8 16",
    "--backbone IResNet200 --image-size 56 56 --batch 4 8",
    "--backbone IResNet200 --image-size 56 56 --batch 4 8 --recompute",
    "--backbone ViT_H --image-size 56 56 --batch 2 4 --recompute",
    "--backbone ViT_H --image-size 56 56 --batch 2 4",
]

_ABOUT = ("Generated by `python benchmarks/measure_backbone_memory.py --write-table` (do not edit: "
          "run it again; `--only NAME...` re-measures those backbones' entries, `--eval-only` only "
          "the evaluation points, `--train-only` only the training ones). The rows of "
          "plsc.train.plan.measured.BACKBONES: each a backbone at an image size, with or without "
          "recompute, its {batch: bytes} points, the arguments that measured it, the machine and "
          "the date.")


def _machine():
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                   "unknown CPU")
    import paddle
    return f"{cpu}, {os.cpu_count()} cores, Paddle {paddle.__version__}"


def _table():
    """(the table's path, its rows): plsc.train.plan.measured's."""
    sys.path.insert(0, ROOT)
    from plsc.train.plan import measured
    return measured.TABLE, dict(measured.BACKBONES)


def write_table(parser, only, missing=False, parts=None, match=None):
    """Measure the `TABLE` entries (those of the backbones in `only`, when given; with
    `missing`, only those the table has no row for; with `match`, only those whose arguments
    contain it) and rewrite the table with them, keeping
    the other rows as they were. `parts`: only these of a row's points ("train": the
    trainer's step, "act": the step with the gradients kept, "eval": the evaluation's, for
    the rows that have them), its other points kept; None: the whole row."""
    import datetime
    path, rows = _table()
    machine = _machine()
    picked = [(e, parser.parse_args(e.split())) for e in TABLE if not match or match in e]
    picked = [(e, a) for e, a in picked if not only or a.backbone in only]
    if not picked:  # a misspelt backbone or text would otherwise measure nothing, silently
        asked = ([f"--only {' '.join(only)}"] if only else []) + (
            [f"--match {match!r}"] if match else [])
        parser.error(f"no TABLE entry has {' and '.join(asked)}: see the TABLE in "
                     f"{os.path.relpath(__file__)}")
    for entry, args in picked:
        key = (args.backbone, *args.image_size, args.recompute)
        if missing and key in rows:
            continue
        todo = [p for p in parts or () if p != "eval" or args.eval_batch]
        if parts and not todo:
            continue
        if todo and key in rows:
            row, params = dict(rows[key]), rows[key]["params"]
            for part in todo:
                points, params = _points(args, part, args.eval_batch if part == "eval"
                                         else args.batch)
                row.update(points)
        else:
            row, params = measure(args)
        rows[key] = dict(row, params=params, arguments=entry, machine=machine,
                         date=datetime.date.today().isoformat())
        print(json.dumps({"row": list(key), **row}), flush=True)
        _write(path, rows)


def _write(path, rows):
    """The table as JSON: its rows sorted by name, larger sizes first (`measured.read_table`
    reads it)."""
    out = {"about": _ABOUT, "rows": []}
    for key in sorted(rows, key=lambda k: (k[0], -k[1] * k[2], k[3])):
        name, height, width, recompute = key
        out["rows"].append(dict(backbone=name, height=height, width=width, recompute=recompute,
                                **rows[key]))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backbone")
    p.add_argument("--image-size", type=int, nargs=2, default=[112, 112])
    p.add_argument("--embedding-size", type=int, default=512)
    p.add_argument("--batch", type=int, nargs="+", default=[8, 16])
    p.add_argument("--eval-batch", type=int, nargs="*", default=[])
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--steps", type=int, default=1,
                   help="measured training steps a process, after the warm-up step")
    p.add_argument("--eval-steps", type=int, default=10,
                   help="evaluation forwards a process (the demo's evaluation: 1,000 images "
                        "and their flips a rank at 200)")
    p.add_argument("--repeats", type=int, default=1,
                   help="processes per point, the median's resident set kept")
    p.add_argument("--eval-repeats", type=int, default=5,
                   help="processes per evaluation point at least (its resident set moves more)")
    p.add_argument("--no-release", dest="release", action="store_false",
                   help="keep malloc's freed blocks between steps (the trainer gives them back "
                        "after each of its first steps: cpu_setup.release_freed_memory)")
    p.add_argument("--keep-gradients", action="store_true",
                   help="keep the gradients allocated between steps (zeroed) instead of freeing "
                        "them as the trainer does: the step's peak is then its activations, "
                        "without the floor of a peak reached once every gradient exists (the "
                        "table measures both ways: act_rss, act_alloc)")
    p.add_argument("--write-table", action="store_true",
                   help="measure every entry of TABLE and write plsc/train/plan/measured_table.json")
    p.add_argument("--only", nargs="*", default=[],
                   help="with --write-table: only these backbones' entries (e.g. IResNet50)")
    p.add_argument("--match", help="with --write-table: only the entries whose arguments "
                   "contain this text (e.g. --match='--image-size 56 56 --optimizer adamw "
                   "--batch 4 8 16 32')")
    p.add_argument("--missing", action="store_true",
                   help="with --write-table: only the entries the table has no row for")
    p.add_argument("--eval-only", action="store_true",
                   help="with --write-table: only the evaluation points (the others kept)")
    p.add_argument("--train-only", action="store_true",
                   help="with --write-table: only the training points (the others kept)")
    p.add_argument("--act-only", action="store_true",
                   help="with --write-table: only the points with the gradients kept (act_rss, "
                        "act_alloc; the others kept)")
    p.add_argument("--child", action="store_true")
    p.add_argument("--mode", choices=("train", "eval"), default="train")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.write_table:
        parts = {part for part, on in (("eval", args.eval_only), ("train", args.train_only),
                                       ("act", args.act_only)) if on}
        return write_table(parser(), args.only, args.missing, parts or None, args.match)
    if not args.backbone:
        raise SystemExit("--backbone is required (or --write-table)")
    if args.child:
        args.batch = args.batch[0]
        return child(args)
    row, params = measure(args)
    print(json.dumps({"backbone": args.backbone, "image_size": args.image_size,
                      "recompute": args.recompute, "params": params, "batches": args.batch,
                      "eval_batches": args.eval_batch, **row}))


if __name__ == "__main__":
    sys.exit(main())
