"""Parity with arcface_torch: plsc trained as arcface_torch's `train_v2.py` trains, step by step.

    python benchmarks/recipe_parity.py --torch-python /path/to/torch/venv/bin/python \\
        --arcface-torch /path/to/insightface/recognition/arcface_torch \\
        --case iresnet18_arcface --steps 20 --batch 8

For each case, `benchmarks/recipe_parity_torch.py` runs under the given torch interpreter with
the arcface_torch checkout on its path (torch and arcface_torch are never a dependency of plsc,
its tests or CI): it builds the case's backbone and `PartialFC_V2` with a seed, writes the
initial weights and fixed random batches, and trains N steps as `train_v2.py` does, once in
float32 and once in float64 from the same weights. This script then trains plsc on the same
batches from the same weights through its `Trainer` (`train_step` on the batches), configured
to the recipe:

- the backbone's weights imported from the `.pt` with `Global.pretrained` (plsc's arcface_torch
  import), the head's centres set to `PartialFC_V2`'s;
- ArcFace with `Loss.straight_through: true` (arcface_torch applies the angular margin under
  `torch.no_grad()`); CosFace's gradient is exact in both;
- `Optimizer.grad_clip: 5` (global norm of the backbone's gradients, as `clip_grad_norm_`);
- SGD momentum 0.9, weight decay 5e-4, or AdamW (betas 0.9, 0.999, eps 1e-8, weight decay
  0.1), on every backbone parameter and on the head, as `train_v2.py`'s one optimizer over both
  parameter groups (Paddle's Momentum/AdamW and plsc's SparseMomentum/SparseAdamW decay every
  parameter they hold: BatchNorm, PReLU and biases included, as torch's);
- `Model.bn_unbiased_var: true` (torch's running variance);
- the learning rate of each step from `PolynomialLRWarmup`'s definition (`lr_scheduler.py`,
  power 1, as `train_v2.py` builds it), computed here, checked against the rates the torch run
  used, and set into plsc's schedule, so the comparison does not depend on plsc's own schedule
  options.

Partial FC below 1 (`wf42m_vit_t_pfc03`: sample rate 0.3, AdamW): plsc updates the sampled
centres only (value, moments, decay and each row's step count), arcface_torch's `PartialFC_V2`
leaves every centre to `train_v2.py`'s optimizer, which moves an unsampled one by its moments
and decays it. The comparison accounts for that: the torch side first writes the weights and
batches, this script computes the centres plsc's head draws for those labels
(`sampled_centres`, saved as `sampled.npy`), the torch runs replay them in `PartialFC_V2.sample`
and update the head with torch's AdamW skipping the unsampled rows (`SampledRowsAdamW` there),
and plsc's Trainer is checked to draw exactly those centres at every step. A fourth torch run,
t32r (float32, the recipe's AdamW over every centre), is reported against t64 as
`recipe_every_row`: the size of the difference set aside. One rank only.

With `--ranks 2` both sides run arcface_torch's recipe on 2 ranks: plsc's Trainer on 2 ranks
launched for real (`python -m paddle.distributed.launch --nproc_per_node 2` on this file's
`--worker` entry), rank r training on samples [r·B/2, (r+1)·B/2) of every batch of B (the
head class-sharded, each rank's shard set from `PartialFC_V2`'s centres; every rank writes its
final shard with its first class, rank 0 its losses and backbone); the torch side emulates
`train_v2.py` on 2 ranks (DDP with per-rank BatchNorm) in one process, exactly:
`recipe_parity_torch.py`'s `two_rank_embeddings` says why, `recipe_parity_ddp_check.py` checks
it against 2 real gloo ranks.

It prints one JSON line per case: per-step |loss_plsc - loss_t64| and |loss_t32 - loss_t64|
(max, rms, final, and every step), the final weights' relative L2 distances to the float64 run
(backbone: every float of its state_dict, BatchNorm statistics included; head: the centres),
also relative to the float64 run's update (final - initial), and plsc's ratio to float32
torch's own distance: float32 rounding is the yardstick. Without --torch-python and
--arcface-torch it prints that it did not run and exits 0.
"""
import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_SIDE = os.path.join(HERE, "recipe_parity_torch.py")

# The recipes' values (arcface_torch's train_v2.py, configs/base.py and the configs named).
CASES = {
    "iresnet18_arcface": dict(
        network="r18", num_classes=100, optimizer="sgd", lr=0.1, weight_decay=5e-4,
        loss={"margin": "arcface", "scale": 64.0, "m2": 0.5, "straight_through": True},
        model={}),
    "iresnet50_cosface_pfc": dict(
        network="r50", num_classes=200, optimizer="sgd", lr=0.1, weight_decay=5e-4,
        loss={"margin": "cosface", "scale": 64.0, "m3": 0.4, "sample_ratio": 1.0},
        model={}),
    "vit_t_adamw": dict(
        network="vit_t", num_classes=100, optimizer="adamw", lr=1e-3, weight_decay=0.1,
        loss={"margin": "cosface", "scale": 64.0, "m3": 0.4, "sample_ratio": 1.0},
        # stochastic depth and token masking off on both sides: their draws cannot be shared
        model={"drop_path_rate": 0.0, "mask_ratio": 0.0}),
    # configs/arcface_r50.yaml's and configs/cosface_r100.yaml's backbone, head and optimizer
    # (the test checks them against the configs), at 100 classes
    "arcface_r50": dict(
        network="r50", num_classes=100, optimizer="sgd", lr=0.1, weight_decay=5e-4,
        loss={"margin": "arcface", "scale": 64.0, "m2": 0.5, "straight_through": True},
        model={}, config="configs/arcface_r50.yaml"),
    "cosface_r100": dict(
        network="r100", num_classes=100, optimizer="sgd", lr=0.1, weight_decay=5e-4,
        loss={"margin": "cosface", "scale": 64.0, "m3": 0.4, "sample_ratio": 1.0},
        model={}, config="configs/cosface_r100.yaml"),
    # configs/wf42m_vit_t_pfc03.yaml's head and optimizer (the test checks them against it):
    # Partial FC 0.3 with AdamW. plsc updates the sampled centres only, train_v2.py's AdamW
    # every centre: the torch runs skip the unsampled rows (recipe_parity_torch.py's
    # SampledRowsAdamW) on plsc's draw of centres; t32r is the recipe's every-row update.
    "wf42m_vit_t_pfc03": dict(
        network="vit_t", num_classes=100, optimizer="adamw", lr=1e-3, weight_decay=0.1,
        loss={"margin": "cosface", "scale": 64.0, "m3": 0.4, "sample_ratio": 0.3},
        model={"drop_path_rate": 0.0, "mask_ratio": 0.0}, config="configs/wf42m_vit_t_pfc03.yaml"),
}
BOUND = 4.0  # issue 46: plsc's distance to float64 at most 4x float32 torch's own


def polynomial_lr_warmup(base_lr, warmup, total, steps, power=1.0):
    """The rate of each optimizer step (0-based) under arcface_torch's `PolynomialLRWarmup`
    stepped once after every optimizer step, as `train_v2.py` does. Its `get_lr` at scheduler
    epoch e (the rate optimizer step e uses): e == 0 or e > total: the rate as it is (so step 0
    runs at the full base rate); e <= warmup: base·e/warmup; else the previous rate times
    ((1 - (e-w)/(t-w)) / (1 - (e-1-w)/(t-w)))^power (chained, the same arithmetic here)."""
    lrs, lr = [], base_lr
    for e in range(steps):
        if e == 0 or e > total:
            pass
        elif e <= warmup:
            lr = base_lr * e / warmup
        else:
            w, t = warmup, total
            lr = lr * ((1.0 - (e - w) / (t - w)) / (1.0 - (e - 1 - w) / (t - w))) ** power
        lrs.append(lr)
    return lrs


def run_torch(args, case, out):
    """The torch runs. With Partial FC below 1 in two stages: the weights and batches first,
    then plsc's draw of centres for those labels (`sampled_centres`) into `sampled.npy`, then
    the runs, which take each step's centres from it."""
    cmd = [args.torch_python, TORCH_SIDE, "--arcface-torch", args.arcface_torch, "--case", case,
           "--steps", str(args.steps), "--batch", str(args.batch), "--warmup", str(args.warmup),
           "--total", str(args.total), "--seed", str(args.seed), "--out", out]
    if args.ranks != 1:
        cmd += ["--ranks", str(args.ranks)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    ratio = CASES[case]["loss"].get("sample_ratio", 1.0)
    if ratio < 1:
        if args.ranks != 1:
            raise RuntimeError(f"{case}: Partial FC below 1 is compared on one rank")
        _torch_stage(cmd + ["--stage", "prepare"])
        labels = np.load(os.path.join(out, "labels.npy"))
        sampled = sampled_centres(labels, CASES[case]["num_classes"], ratio, args.seed)
        np.save(os.path.join(out, "sampled.npy"), sampled)
        cmd += ["--stage", "train", "--sampled", os.path.join(out, "sampled.npy")]
    _torch_stage(cmd)
    with open(os.path.join(out, "torch.json")) as f:
        return json.load(f)


def _torch_stage(cmd):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"the torch side failed ({res.returncode}):\n{res.stderr[-4000:]}")


def sampled_centres(labels, num_classes, ratio, seed):
    """`[steps, num_sample]` int64: the centres plsc's one-rank head draws at each step for
    these labels (`plsc.nn.sampling.sample_centres` with the head's seed, step and rank 0, as
    `PartialFC` calls it); `train_plsc` checks that its Trainer drew exactly these."""
    import plsc  # noqa: F401  -- before paddle, as in train_plsc
    import paddle
    from plsc.nn.sampling import sample_centres
    return np.stack([sample_centres(paddle.to_tensor(lab), num_classes, ratio, seed, step,
                                    0)[0].numpy() for step, lab in enumerate(labels)])


def plsc_config(args, spec, work):
    from plsc.config import apply_overrides, validate
    root = os.path.join(work, "data")
    n = args.batch  # the Trainer needs a training set; the steps below feed the saved batches
    ranks = getattr(args, "ranks", 1)
    raw = {
        "Global": {"seed": args.seed, "output_dir": os.path.join(work, "plsc_out"),
                   "device": "cpu", "max_steps": args.steps, "log_interval": 10 ** 6,
                   "pretrained": os.path.join(work, "init_backbone.pt"),
                   "cpu_threads": args.threads or None},
        "Model": {"name": spec["network"], "embedding_size": 512, "dropout": 0.0,
                  "bn_unbiased_var": True, **spec["model"]},
        "Loss": {"num_classes": spec["num_classes"], "sample_ratio": 1.0, **spec["loss"]},
        "Data": {"dataset": "synthetic", "root": root, "image_size": [112, 112],
                 "batch_size": args.batch // ranks, "num_workers": 0, "random_flip": False,
                 "synthetic": {"num_identities": 2, "images_per_identity": n,
                               "num_val_identities": 2, "num_pairs": 2}},
        "Optimizer": {"name": spec["optimizer"], "lr": spec["lr"], "momentum": 0.9,
                      "weight_decay": spec["weight_decay"], "betas": [0.9, 0.999],
                      "grad_clip": 5.0, "base_batch_size": None},
        "LRScheduler": {"name": "poly", "warmup_steps": 0},  # replaced by the recipe's rates
        "Checkpoint": {"interval": 10 ** 6},
        "Logging": {"visualdl": False, "progress_bar": False},
    }
    # -o Section.key=value: plsc set otherwise than the recipe, to see what a difference costs
    return validate(apply_overrides(raw, args.overrides), source="recipe_parity")


def run_plsc(args, spec, work, lrs):
    """plsc's Trainer on the saved batches: (losses, {arcface_torch key: final array},
    final head weight, the config's recipe-relevant values). With --ranks 2: on 2 ranks
    launched by `paddle.distributed.launch` (`worker`), read back from the files they write."""
    if args.ranks == 1:
        losses, final, head, options, _ = train_plsc(args, spec, work, lrs)
        return losses, final, head, options
    return run_plsc_ranks(args, work, lrs)


def run_plsc_ranks(args, work, lrs):
    """`worker` on `args.ranks` ranks (`python -m paddle.distributed.launch --nproc_per_node
    N recipe_parity.py --worker SPEC`); rank 0's losses, options and backbone, and the head's
    rows from every rank's shard (each rank writes its own, with its first class: exact)."""
    out = os.path.join(work, "plsc_ranks")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    spec_file = os.path.join(out, "worker.json")
    with open(spec_file, "w") as f:
        json.dump({"args": {k: getattr(args, k) for k in (
            "steps", "batch", "seed", "threads", "overrides", "ranks")},
            "case": args.current_case, "work": work, "lrs": lrs, "out": out}, f)
    log_dir = os.path.join(out, "logs")
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node",
           str(args.ranks), "--log_dir", log_dir, os.path.abspath(__file__), "--worker", spec_file]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE),
                                                     env.get("PYTHONPATH")) if p)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0 or not os.path.isfile(os.path.join(out, "rank0.json")):
        logs = ""
        for r in range(args.ranks):
            path = os.path.join(log_dir, f"workerlog.{r}")
            if os.path.isfile(path):
                with open(path) as f:
                    logs += f"--- rank {r}\n{f.read()[-3000:]}"
        raise RuntimeError(f"the plsc ranks failed ({res.returncode}):\n{res.stderr[-2000:]}"
                           f"\n{logs}")
    with open(os.path.join(out, "rank0.json")) as f:
        r0 = json.load(f)
    final = dict(np.load(os.path.join(out, "backbone_rank0.npz")))
    shards = []
    for r in range(args.ranks):
        z = np.load(os.path.join(out, f"head_rank{r}.npz"))
        shards.append((int(z["class_start"]), z["weight"]))
    shards.sort(key=lambda t: t[0])
    starts = [s for s, _ in shards]
    sizes = [w.shape[0] for _, w in shards]
    if starts != [sum(sizes[:i]) for i in range(len(sizes))]:
        raise RuntimeError(f"the head's shards do not tile the classes: starts {starts}, "
                           f"sizes {sizes}")
    head = np.concatenate([w for _, w in shards])
    return r0["losses"], final, head, r0["options"]


def worker(spec_file):
    """One rank of --ranks N: the Trainer on this rank's part of every batch (rank r: samples
    [r·B/N, (r+1)·B/N)); writes this rank's head shard, and on rank 0 the losses (the head's
    loss is the global batch's mean, the same on every rank), options and final backbone."""
    with open(spec_file) as f:
        spec_all = json.load(f)
    args = argparse.Namespace(**spec_all["args"])
    out = spec_all["out"]
    losses, final, head, options, (rank, class_start) = train_plsc(
        args, CASES[spec_all["case"]], spec_all["work"], spec_all["lrs"])
    np.savez(os.path.join(out, f"head_rank{rank}.npz"), weight=head, class_start=class_start)
    if rank == 0:
        np.savez(os.path.join(out, "backbone_rank0.npz"), **final)
        options["ranks"] = args.ranks
        with open(os.path.join(out, "rank0.json"), "w") as f:
            json.dump({"losses": losses, "options": options}, f)
    return 0


def train_plsc(args, spec, work, lrs):
    """The Trainer of this process (one of `args.ranks`) on its part of the saved batches:
    (losses, final backbone, this rank's head rows, options, (rank, first class))."""
    import plsc  # noqa: F401  -- before paddle: plsc's CPU set-up precedes any matrix product
    import paddle
    from plsc.models import plsc_to_insightface
    from plsc.train import Trainer

    cfg = plsc_config(args, spec, work)
    trainer = Trainer(cfg)
    try:
        trainer.lr.lr_fn = lambda step: lrs[min(step, len(lrs) - 1)]
        trainer.lr.last_lr = float(lrs[0])
        head = trainer.head
        if head.sub_centers != 1:
            raise RuntimeError("recipe_parity: one centre per class")
        with paddle.no_grad():  # this rank's rows of PartialFC_V2's centres
            head.weight.set_value(np.ascontiguousarray(np.load(os.path.join(
                work, "init_head.npy"))[head.class_start:head.class_start + head.num_local]))
        ranks, rank = getattr(args, "ranks", 1), trainer.rank
        if trainer.world != ranks:
            raise RuntimeError(f"{trainer.world} ranks, expected {ranks}")
        part = slice(rank * args.batch // ranks, (rank + 1) * args.batch // ranks)
        trainer.backbone.train()
        trainer.head.train()
        images = np.load(os.path.join(work, "images.npy"), mmap_mode="r")
        labels = np.load(os.path.join(work, "labels.npy"))
        sampled_file = os.path.join(work, "sampled.npy")
        sampled = np.load(sampled_file) if head.sample_ratio < 1 else None
        losses, used = [], []
        for step in range(args.steps):
            used.append(trainer.lr.last_lr)
            img = paddle.to_tensor(np.ascontiguousarray(images[step][part]))
            lab = paddle.to_tensor(np.ascontiguousarray(labels[step][part]))
            losses.append(float(trainer.train_step([(img, lab)])))
            if sampled is not None and not np.array_equal(head.sampled_index.numpy(),
                                                          sampled[step]):
                raise RuntimeError(f"step {step}: the Trainer drew other centres than "
                                   f"{sampled_file} (the torch runs')")
        final = plsc_to_insightface(trainer.backbone)
        head_rows = trainer.head.weight.numpy()
        o, loss, m = cfg["Optimizer"], cfg["Loss"], cfg["Model"]
        options = {"margin": repr(head.margin),  # the margin built, with its values
                   "sample_ratio": loss["sample_ratio"], "optimizer": o["name"],
                   "momentum": o["momentum"] if o["name"] == "sgd" else None,
                   "betas": o["betas"] if o["name"] == "adamw" else None,
                   "weight_decay": o["weight_decay"], "grad_clip": o["grad_clip"],
                   "bn_unbiased_var": m["bn_unbiased_var"],
                   "fused_head_update": trainer.fused_head_update,
                   "lr_used_matches": bool(np.allclose(used, lrs[:args.steps], rtol=0, atol=0))}
        if args.overrides:
            options["overrides"] = list(args.overrides)
        for key in ("drop_path_rate", "mask_ratio"):
            if m.get(key) is not None:
                options[key] = m[key]
        return losses, final, head_rows, options, (rank, head.class_start)
    finally:
        trainer.close()


def _flat(state, keys):
    return np.concatenate([np.asarray(state[k], np.float64).ravel() for k in keys])


def distances(final, ref, init):
    """(||final - ref|| / ||ref||, ||final - ref|| / ||ref - init||) over `ref`'s float keys."""
    keys = [k for k in ref if np.asarray(ref[k]).dtype.kind == "f"]
    a, b, i = _flat(final, keys), _flat(ref, keys), _flat(init, keys)
    d = float(np.linalg.norm(a - b))
    return d / float(np.linalg.norm(b)), d / float(np.linalg.norm(b - i))


def _ratio(a, b):
    return a / b if b > 0 else (math.inf if a > 0 else 1.0)


def _summary(diffs):
    d = np.asarray(diffs)
    return {"max": float(d.max()), "rms": float(np.sqrt(np.mean(d * d))), "final": float(d[-1])}


def run_case(args, case):
    spec = CASES[case]
    args.current_case = case
    if args.work:
        work = os.path.join(os.path.abspath(args.work), case)
        os.makedirs(work, exist_ok=True)
    else:
        work = tempfile.mkdtemp(prefix=f"recipe_parity_{case}_")
    try:
        t0 = time.time()
        tor = _reused_torch_run(args, work)
        reused = tor is not None
        if tor is None:
            tor = run_torch(args, case, work)
            with open(os.path.join(work, "args.json"), "w") as f:
                json.dump(_torch_args(args), f)
        t_torch = time.time() - t0
        shutil.rmtree(os.path.join(work, "plsc_out"), ignore_errors=True)
        lrs = polynomial_lr_warmup(spec["lr"], args.warmup, args.total, args.steps)
        for tag in ("t32", "t64"):
            if not np.allclose(tor[tag]["lrs"], lrs, rtol=1e-12, atol=0):
                raise RuntimeError(f"PolynomialLRWarmup's rates as computed here {lrs} differ "
                                   f"from the torch run's {tor[tag]['lrs']}")
        t0 = time.time()
        losses, final_plsc, head_plsc, options = run_plsc(args, spec, work, lrs)
        t_plsc = time.time() - t0
        if args.work:  # for a closer look, key by key
            np.savez(os.path.join(work, "final_plsc.npz"), **final_plsc,
                     **{"head.weight": head_plsc})

        from plsc import torchfile
        init = {k: np.asarray(v) for k, v in
                torchfile.load(os.path.join(work, "init_backbone.pt")).items()}
        init_head = np.load(os.path.join(work, "init_head.npy"))
        t32, t64, t32x = (dict(np.load(os.path.join(work, f"final_{tag}.npz")))
                          for tag in ("t32", "t64", "t32x"))
        l32, l64, l32x = (np.array(tor[tag]["losses"]) for tag in ("t32", "t64", "t32x"))
        lp = np.array(losses)
        d_plsc, d_t32, d_t32x = np.abs(lp - l64), np.abs(l32 - l64), np.abs(l32x - l64)
        s_plsc, s_t32, s_t32x = _summary(d_plsc), _summary(d_t32), _summary(d_t32x)
        head64, head32, head32x = ({"w": f.pop("head.weight")} for f in (t64, t32, t32x))
        stats = [k for k in t64 if k.endswith(("running_mean", "running_var"))]
        bn64 = {k: t64[k] for k in stats}
        bb = {"plsc": distances(final_plsc, t64, init), "t32": distances(t32, t64, init),
              "t32x": distances(t32x, t64, init)}
        bn = {"plsc": distances(final_plsc, bn64, init), "t32": distances(t32, bn64, init),
              "t32x": distances(t32x, bn64, init)} if stats else None
        hd = {"plsc": distances({"w": head_plsc}, head64, {"w": init_head}),
              "t32": distances(head32, head64, {"w": init_head}),
              "t32x": distances(head32x, head64, {"w": init_head})}
        report = {
            "benchmark": "recipe_parity", "case": case, "steps": args.steps, "batch": args.batch,
            "ranks": args.ranks,
            "loss_abs_diff": {"plsc_vs_t64": s_plsc, "t32_vs_t64": s_t32,
                              "ratio": {k: _ratio(s_plsc[k], s_t32[k]) for k in s_plsc},
                              "t32x_vs_t64": s_t32x,
                              "ratio_t32x": {k: _ratio(s_plsc[k], s_t32x[k]) for k in s_plsc}},
            "final_weights_rel_l2": {
                part: {"plsc_vs_t64": d["plsc"][0], "t32_vs_t64": d["t32"][0],
                       "ratio": _ratio(d["plsc"][0], d["t32"][0]),
                       "t32x_vs_t64": d["t32x"][0],
                       "ratio_t32x": _ratio(d["plsc"][0], d["t32x"][0]),
                       "of_update": {"plsc_vs_t64": d["plsc"][1], "t32_vs_t64": d["t32"][1],
                                     "t32x_vs_t64": d["t32x"][1]}}
                for part, d in (("backbone", bb), ("head", hd), ("backbone_bn_stats", bn))
                if d is not None},
            "per_step": {"loss_t64": [round(float(v), 6) for v in l64],
                         "plsc_vs_t64": [float(f"{v:.3g}") for v in d_plsc],
                         "t32_vs_t64": [float(f"{v:.3g}") for v in d_t32],
                         "t32x_vs_t64": [float(f"{v:.3g}") for v in d_t32x]},
            "clip_norm_step1": {tag: tor[tag]["grad_norms"][0] for tag in ("t64", "t32", "t32x")},
            "lr": {"schedule": "PolynomialLRWarmup", "base": spec["lr"], "warmup_iters":
                   args.warmup, "total_iters": args.total, "power": 1.0,
                   "first": lrs[:args.warmup + 2]},
            "options": options,
            **_every_row(tor, work, l64, t64, head64, init, init_head),
            "seconds": {"torch_t32_and_t64": None if reused else round(t_torch, 1),
                        "plsc": round(t_plsc, 1)},
            "versions": {"torch": tor["torch"], "paddle": _paddle_version(),
                         "python": platform.python_version()},
        }
        ratios = [report["loss_abs_diff"]["ratio"]["max"],
                  report["final_weights_rel_l2"]["backbone"]["ratio"],
                  report["final_weights_rel_l2"]["head"]["ratio"]]
        strict = [report["loss_abs_diff"]["ratio_t32x"]["max"]] + [
            report["final_weights_rel_l2"][part]["ratio_t32x"] for part in ("backbone", "head")]
        report["within_bound"] = {"bound": BOUND, "ok": all(r <= BOUND for r in ratios),
                                  "ok_against_t32x": all(r <= BOUND for r in strict)}
        return report
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def _every_row(tor, work, l64, t64, head64, init, init_head):
    """Partial FC: how far t32r (train_v2.py's AdamW on every centre, the recipe) ends from
    t64 (unsampled rows skipped), beside t32's float32 rounding: the size of the difference
    that skipping the unsampled rows accounts for. Empty for the other cases."""
    if "t32r" not in tor:
        return {}
    t32r = dict(np.load(os.path.join(work, "final_t32r.npz")))
    head = {"w": t32r.pop("head.weight")}
    loss = np.abs(np.array(tor["t32r"]["losses"]) - l64)
    return {"recipe_every_row": {
        "what": "t32r: train_v2.py's AdamW on every centre (moments and decay), float32, "
                "against t64 (unsampled centres skipped)",
        "loss_abs_diff": _summary(loss),
        "final_weights_rel_l2": {"backbone": distances(t32r, t64, init)[0],
                                 "head": distances(head, head64, {"w": init_head})[0]}}}


def _torch_args(args):
    kept = {k: getattr(args, k) for k in ("steps", "batch", "warmup", "total", "seed")}
    if args.ranks != 1:  # (one-process runs kept before --ranks existed stay reusable)
        kept["ranks"] = args.ranks
    return kept


def _reused_torch_run(args, work):
    """The torch runs already in `work` (--work) if they were made with the same arguments."""
    try:
        with open(os.path.join(work, "args.json")) as f:
            same = json.load(f) == _torch_args(args)
        with open(os.path.join(work, "torch.json")) as f:
            return json.load(f) if same else None
    except (OSError, ValueError):
        return None


def _paddle_version():
    import paddle
    return paddle.__version__


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch-python", help="a Python interpreter with torch (and timm for ViTs)")
    ap.add_argument("--arcface-torch", help="insightface's recognition/arcface_torch folder")
    ap.add_argument("--case", action="append", choices=sorted(CASES),
                    help="repeat for several; default: all")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=5, help="PolynomialLRWarmup's warmup_iters")
    ap.add_argument("--total", type=int, default=20, help="PolynomialLRWarmup's total_iters")
    ap.add_argument("--seed", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of each side (0: theirs)")
    ap.add_argument("--ranks", type=int, default=1, choices=(1, 2),
                    help="2: plsc on 2 ranks (paddle.distributed.launch), each on half of every "
                         "batch, against arcface_torch on 2 ranks (DDP) emulated in one process")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # one rank of --ranks N (internal)
    ap.add_argument("--work", help="keep the files in WORK/<case> (default: a temporary folder, "
                    "removed); the torch runs found there with the same arguments are reused")
    ap.add_argument("-o", dest="overrides", action="append", default=[],
                    metavar="Section.key=value",
                    help="set plsc's config otherwise than the recipe (e.g. "
                         "Loss.straight_through=false) to measure what a difference costs")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.batch % args.ranks:
        ap.error(f"--batch {args.batch} is not a multiple of --ranks {args.ranks}")
    if not args.torch_python or not args.arcface_torch:
        print(json.dumps({"benchmark": "recipe_parity", "status": "not run",
                          "reason": "needs --torch-python and --arcface-torch"}))
        return 0
    one_rank = [c for c in CASES if CASES[c]["loss"].get("sample_ratio", 1.0) < 1]
    if args.ranks != 1 and set(args.case or ()) & set(one_rank):
        ap.error(f"{', '.join(one_rank)}: one rank only (Partial FC below 1)")
    status = 0
    for case in args.case or [c for c in CASES if args.ranks == 1 or c not in one_rank]:
        report = run_case(args, case)
        print(json.dumps(report), flush=True)
        status |= 0 if report["within_bound"]["ok"] else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
