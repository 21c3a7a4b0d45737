"""Whole training runs, plsc beside arcface_torch: samples per second after a warm-up, a
breakdown of plsc's step, and each rank's peak resident memory; one JSON document.

    python benchmarks/benchmark_train.py --out train.json --markdown      # plsc only
    python benchmarks/benchmark_train.py --torch-python /path/to/torchvenv/bin/python \\
        --arcface-torch /path/to/insightface/recognition/arcface_torch --out train.json --markdown
    python benchmarks/benchmark_train.py --cases r18 --steps 3 --warmup 1 --repeats 1 \\
        --batch 8 --classes 100      # a smoke run

Both sides train on the same images (a synthetic image folder of identities generated here,
112 x 112 JPEGs, cached under --workdir), on 2 ranks of 1 thread each (OMP_NUM_THREADS=1 and
each framework's own setting), with the same per-rank batch (so the same global batch), the
same number of steps and --workers loader worker processes per rank. Each repeat is a fresh
launch of each side; the figures are medians over the repeats.

- plsc: `python -m paddle.distributed.launch --nproc_per_node 2 tools/train.py -c CONFIG -o
  ...` with a config written here for the case (Data.dataset folder, Global.cpu_threads 1,
  Global.max_steps warm-up + steps, everything else plsc's defaults or the case's recipe).
  `PLSC_STEP_TIMES` makes the trainer time each step by phase (plsc/train/timers.py); rank
  0's steps after the warm-up give samples/s and the breakdown (ms per step). The final
  checkpoint is not in any step's time.
- arcface_torch: benchmarks/benchmark_train_torch.py (train_v2.py's loop built from the
  checkout's modules; see its docstring) under `torchrun --nproc_per_node 2` from
  --torch-python; without --torch-python and --arcface-torch its column says "not run".
- Peak RSS: each rank's VmHWM as its training ends (loader workers not counted).
- ISA caps (--isa, benchmarks/isa_cap.py): `avx2` starts both sides' launchers (so their ranks
  and loader workers) with oneDNN, MKL, numpy, OpenBLAS and ATen capped at AVX2, `native`
  with none of those variables; several caps alternate within each repeat. The document
  carries the CPU's SIMD flags, each cap's variables and a probe, per cap and side, of what
  oneDNN, numpy and ATen then run (a small process started with the same environment).

Cases (--cases): r18 (IResNet18, CosFace, dense head of --classes, default 1000, SGD), r50_pfc
(IResNet50, ArcFace, Partial FC 0.1 over 100,000 classes, SGD), vit_t (ViT-T as in
arcface_torch's WebFace42M recipe, CosFace, Partial FC 0.3 over 10,000 classes, AdamW). plsc
runs its default float32 gradient all-reduce; arcface_torch sends the backbone's gradients in
float16 (train_v2.py's DDP compression hook). `--grad-allreduce-dtype float16` gives plsc its
recipe configs' setting (configs/arcface_r50.yaml, configs/wf42m_vit_t_pfc03.yaml): half the
bytes, but on gloo an all-gather and casts that cost more than they save on 2 CPU ranks.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import isa_cap
from plsc.config import GRAD_SYNC_MODES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS = 2
THREADS = 1
EMBEDDING = 512
CASES = {
    # torch network, plsc Model.name, margin (m1, m2, m3), classes, sample ratio, optimizer, lr, wd
    "r18": ("r18", "IResNet18", (1.0, 0.0, 0.4), 1000, 1.0, "sgd", 0.1, 5e-4),
    "r50_pfc": ("r50", "IResNet50", (1.0, 0.5, 0.0), 100_000, 0.1, "sgd", 0.1, 5e-4),
    "vit_t": ("vit_t_dp005_mask0", "vit_t_dp005_mask0", (1.0, 0.0, 0.4), 10_000, 0.3, "adamw",
              1e-3, 0.1),
}
PHASES = ("data", "backbone", "head", "collectives", "optimizer", "checks_logging")


def case_spec(name, classes=None):
    """The case's settings as a dict (`classes` overrides its number of classes)."""
    net, model, margins, n, ratio, opt, lr, wd = CASES[name]
    return {"case": name, "torch_network": net, "plsc_model": model, "margins": list(margins),
            "classes": classes or n, "sample_ratio": ratio, "optimizer": opt, "lr": lr,
            "weight_decay": wd}


# ------------------------------------------------------------------------------ images
def make_images(root, identities, per_identity, seed=0):
    """A folder of `identities` sub-folders of `per_identity` 112 x 112 JPEGs (plsc's
    synthetic identities); reused when `root` already holds that many."""
    marker = os.path.join(root, "images.json")
    want = {"identities": identities, "per_identity": per_identity, "seed": seed, "size": 112}
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f) == want:
                return root
    import cv2
    import numpy as np
    from plsc.data.synthetic import make_prototype, make_template, render_sample
    from plsc.fileio import write_image
    rng = np.random.default_rng(seed)
    template = make_template(rng, 112)
    for i in range(identities):
        proto = make_prototype(rng, 112, template)
        folder = os.path.join(root, f"id{i:06d}")
        os.makedirs(folder, exist_ok=True)
        for j in range(per_identity):
            img = cv2.cvtColor(render_sample(proto, rng, 1.2), cv2.COLOR_RGB2BGR)
            write_image(os.path.join(folder, f"{j:03d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 92])
    with open(marker, "w") as f:
        json.dump(want, f)
    return root


# ------------------------------------------------------------------------------ plsc
def plsc_config(spec, args, images):
    """The case's plsc config (a dict for YAML)."""
    m1, m2, m3 = spec["margins"]
    loss = ({"margin": "arcface", "m2": m2, "straight_through": True} if m2
            else {"margin": "cosface", "m3": m3})
    loss.update(scale=64.0, num_classes=spec["classes"], sample_ratio=spec["sample_ratio"])
    opt = {"name": spec["optimizer"], "lr": spec["lr"], "weight_decay": spec["weight_decay"],
           "grad_clip": 5.0, "grad_allreduce_dtype": args.grad_allreduce_dtype}
    if spec["optimizer"] == "sgd":
        opt["momentum"] = 0.9
    if args.grad_sync:
        opt["grad_sync"] = args.grad_sync
    return {"Global": {"seed": 0, "device": "cpu", "cpu_threads": THREADS,
                       "max_steps": args.warmup + args.steps, "log_interval": 10},
            "Model": {"name": spec["plsc_model"], "embedding_size": EMBEDDING},
            "Loss": loss,
            "Data": {"dataset": "folder", "root": images, "image_size": [112, 112],
                     "batch_size": args.batch, "num_workers": args.workers},
            "Optimizer": opt,
            "LRScheduler": {"name": "poly", "power": 1.0, "warmup_steps": 0,
                            "warmup_indexing": "arcface_torch"}}


def _env(cap):
    env = isa_cap.cap_env(cap, dict(os.environ, OMP_NUM_THREADS=str(THREADS), PYTHONPATH=REPO))
    env.pop("PLSC_STEP_TIMES", None)
    return env


def _run(cmd, env, log_path):
    """Run `cmd`; returns None or an error with the end of its output."""
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if rc == 0:
        return None
    with open(log_path, errors="replace") as f:
        return f"exit {rc}: " + f.read()[-1500:]


def run_plsc(spec, args, images, run_dir, cap):
    """One launch of tools/train.py; its rank reports (plsc/train/timers.py) or an error."""
    import yaml
    os.makedirs(run_dir, exist_ok=True)
    cfg_path = os.path.join(run_dir, "config.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(plsc_config(spec, args, images), f, sort_keys=False)
    env = _env(cap)
    env["PLSC_STEP_TIMES"] = os.path.join(run_dir, "steps")
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(RANKS),
           "--log_dir", os.path.join(run_dir, "launch"), os.path.join(REPO, "tools", "train.py"),
           "-c", cfg_path, "-o", f"Global.output_dir={os.path.join(run_dir, 'output')}"]
    error = _run(cmd, env, os.path.join(run_dir, "run.log"))
    return error or _read_ranks(os.path.join(run_dir, "steps"))


def _read_ranks(prefix):
    reports = []
    for r in range(RANKS):
        path = f"{prefix}.rank{r}.json"
        if not os.path.isfile(path):
            return f"no {path}"
        with open(path) as f:
            reports.append(json.load(f))
    return reports


# ------------------------------------------------------------------------------ torch
def run_torch(spec, args, images, run_dir, cap):
    """One torchrun launch of benchmark_train_torch.py; its rank reports or an error."""
    os.makedirs(run_dir, exist_ok=True)
    prefix = os.path.join(run_dir, "steps")
    cmd = [args.torch_python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc_per_node", str(RANKS),
           os.path.join(REPO, "benchmarks", "benchmark_train_torch.py"),
           "--arcface-torch", os.path.abspath(args.arcface_torch), "--images", images,
           "--spec", json.dumps(spec), "--batch", str(args.batch), "--workers", str(args.workers),
           "--steps", str(args.warmup + args.steps), "--threads", str(THREADS),
           "--out", prefix, "--save-dir", os.path.join(run_dir, "output")]
    env = _env(cap)
    env.pop("PYTHONPATH")
    error = _run(cmd, env, os.path.join(run_dir, "run.log"))
    return error or _read_ranks(prefix)


# ------------------------------------------------------------------------------ summary
def measured(reports, warmup):
    """samples/s, mean step and phase times (ms) of rank 0's steps after `warmup`, and each
    rank's peak RSS, from one run's rank reports (either side's)."""
    steps = reports[0]["steps"][warmup:]
    if not steps:
        raise SystemExit("no step after the warm-up: raise --steps")
    wall = sum(s["wall_s"] for s in steps)
    out = {"samples_per_s": reports[0]["global_batch"] * len(steps) / wall,
           "step_ms": 1000 * wall / len(steps), "steps_timed": len(steps),
           "peak_rss_mb": [round(r["vm_hwm_bytes"] / 2**20, 1) if r.get("vm_hwm_bytes")
                           else None for r in reports]}
    if "torch" in reports[0]:
        out["torch"] = reports[0]["torch"]
    if "vm_hwm_mb" in reports[0]["steps"][0]:  # the torch side: its peak, step by step
        out["peak_rss_mb_by_step"] = [[s["vm_hwm_mb"] for s in r["steps"]] for r in reports]
    phases = [p for p in reports[0].get("phases", ()) if p in steps[0]]
    if phases:
        out["phase_ms"] = {p: 1000 * sum(s[p] for s in steps) / len(steps) for p in phases}
    return out


def median_of(runs):
    """The medians over repeats of `measured` dicts (peak RSS: per rank)."""
    if not runs:
        return None
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    out = {"samples_per_s": med([r["samples_per_s"] for r in runs]),
           "step_ms": med([r["step_ms"] for r in runs]),
           "samples_per_s_repeats": [round(r["samples_per_s"], 3) for r in runs],
           "peak_rss_mb": [med([r["peak_rss_mb"][i] or 0 for r in runs])
                           for i in range(len(runs[0]["peak_rss_mb"]))]}
    if "torch" in runs[0]:
        out["torch"] = runs[0]["torch"]
    if "peak_rss_mb_by_step" in runs[-1]:  # the last repeat's
        out["peak_rss_mb_by_step"] = runs[-1]["peak_rss_mb_by_step"]
    if "phase_ms" in runs[0]:
        out["phase_ms"] = {p: med([r["phase_ms"][p] for r in runs]) for p in runs[0]["phase_ms"]}
    return out


def ratios(result):
    """plsc over arcface_torch: samples/s, and the larger rank's peak RSS (None when a side
    did not run)."""
    plsc, torch = result["plsc"], result["arcface_torch"]
    if not (isinstance(plsc, dict) and isinstance(torch, dict)):
        return {"samples_per_s": None, "peak_rss_per_rank": None}
    return {"samples_per_s": round(plsc["samples_per_s"] / torch["samples_per_s"], 3),
            "peak_rss_per_rank": round(max(plsc["peak_rss_mb"]) / max(torch["peak_rss_mb"]), 3)}


def markdown(doc):
    """The results as two markdown tables: docs/performance.md's summary (CPU flags, cap,
    samples/s, ratios, peak RSS per rank) and plsc's breakdown in ms per step."""
    flags = " ".join(f for f in doc["cpu"]["simd_flags"] if f in ("avx2", "fma", "avx512f",
                                                                 "avx512_bf16", "amx_tile"))
    lines = [f"CPU: {doc['cpu']['model']}, {flags}", "",
             "| case | ISA cap | plsc samples/s | arcface_torch | ratio | peak RSS per rank MB, "
             "plsc / arcface_torch | RSS ratio |", "|" + " --- |" * 7]
    for case, per_cap in doc["cases"].items():
        for cap, res in per_cap["caps"].items():
            def sps(side):
                r = res[side]
                return f"{r['samples_per_s']:.2f}" if isinstance(r, dict) else str(r)[:40]

            def rss(side):
                r = res[side]
                return ("/".join(f"{v:.0f}" for v in r["peak_rss_mb"]) if isinstance(r, dict)
                        else "")
            q = res["ratio"]
            lines.append(f"| {case} | {cap} | {sps('plsc')} | {sps('arcface_torch')} | "
                         f"{q['samples_per_s'] or ''}{'x' if q['samples_per_s'] else ''} | "
                         f"{rss('plsc')} ; {rss('arcface_torch')} | "
                         f"{q['peak_rss_per_rank'] or ''}{'x' if q['peak_rss_per_rank'] else ''} |")
    head = ("| case | ISA cap | side | samples/s | step ms | peak RSS rank 0 / 1 (MB) | "
            + " | ".join(PHASES) + " |")
    lines += ["", head, "|" + " --- |" * (6 + len(PHASES))]
    for case, per_cap in doc["cases"].items():
        for cap, sides in per_cap["caps"].items():
            for side in ("plsc", "arcface_torch"):
                res = sides[side]
                if not isinstance(res, dict):
                    text = " ".join(str(res).split()).replace("|", "/")[:120]
                    lines.append(f"| {case} | {cap} | {side} | {text} |"
                                 + " |" * (3 + len(PHASES)))
                    continue
                rss = " / ".join(f"{v:.0f}" for v in res["peak_rss_mb"])
                phases = [f"{res['phase_ms'][p]:.0f}" if p in res.get("phase_ms", {}) else ""
                          for p in PHASES]
                lines.append(f"| {case} | {cap} | {side} | {res['samples_per_s']:.1f} | "
                             f"{res['step_ms']:.0f} | {rss} | " + " | ".join(phases) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ main
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up")
    p.add_argument("--warmup", type=int, default=5, help="steps not timed")
    p.add_argument("--repeats", type=int, default=3, help="launches of each side per case")
    p.add_argument("--batch", type=int, default=32, help="images per rank (2 ranks)")
    p.add_argument("--workers", type=int, default=2, help="loader workers per rank, both sides")
    p.add_argument("--classes", type=int, help="override every case's number of classes")
    p.add_argument("--grad-allreduce-dtype", default="float32", choices=("float32", "float16"),
                   help="plsc's Optimizer.grad_allreduce_dtype (float32: its default; float16: "
                        "its recipe configs', as arcface_torch's compression hook)")
    p.add_argument("--grad-sync", choices=GRAD_SYNC_MODES,
                   help="plsc's Optimizer.grad_sync (default: the config default's)")
    p.add_argument("--per-identity", type=int, default=20, help="images per identity")
    p.add_argument("--workdir", default=os.path.join(REPO, "output", "benchmark_train"),
                   help="images (cached) and the runs' folders")
    p.add_argument("--torch-python", help="a Python with torch and torchvision: runs "
                   "arcface_torch's side; without it that column says 'not run'")
    p.add_argument("--arcface-torch", help="arcface_torch's directory (with --torch-python)")
    p.add_argument("--isa", nargs="+", default=["native"], choices=list(isa_cap.CAPS),
                   help="instruction-set cap(s) for both sides' processes (benchmarks/isa_cap.py"
                        "); several alternate within each repeat (default: native)")
    p.add_argument("--out", help="write the JSON document here (else stdout)")
    p.add_argument("--markdown", action="store_true", help="also print a markdown table")
    args = p.parse_args(argv)
    if bool(args.torch_python) != bool(args.arcface_torch):
        p.error("--torch-python and --arcface-torch go together")
    if args.arcface_torch and not os.path.isfile(os.path.join(args.arcface_torch,
                                                              "partial_fc_v2.py")):
        p.error(f"--arcface-torch {args.arcface_torch}: no partial_fc_v2.py in it")
    return args


def run_case(name, args, images):
    """Both sides of case `name` under each cap, alternating, --repeats times; their
    medians per cap."""
    spec = case_spec(name, args.classes)
    sides = {"plsc": run_plsc}
    if args.torch_python:
        sides["arcface_torch"] = run_torch
    runs = {(cap, side): [] for cap in args.isa for side in sides}
    errors = {}
    for rep in range(args.repeats):
        for cap in args.isa:
            for side, run in sides.items():
                run_dir = os.path.join(args.workdir, "runs", f"{name}_{cap}_{side}_{rep}")
                got = run(spec, args, images, run_dir, cap)
                tag = f"{name} {cap} {side} repeat {rep}"
                if isinstance(got, str):
                    errors[cap, side] = got
                    print(f"{tag}: failed: {got}", file=sys.stderr)
                else:
                    runs[cap, side].append(measured(got, args.warmup))
                    print(f"{tag}: {runs[cap, side][-1]['samples_per_s']:.2f} samples/s, peak "
                          f"RSS {runs[cap, side][-1]['peak_rss_mb']} MB", file=sys.stderr)
    out = {"spec": spec, "caps": {}}
    for cap in args.isa:
        res = {}
        for side in ("plsc", "arcface_torch"):
            res[side] = (median_of(runs[cap, side]) or f"failed: {errors[cap, side][:300]}"
                         if side in sides else "not run")
        res["ratio"] = ratios(res)
        out["caps"][cap] = res
    return out


def main(argv=None):
    args = parse_args(argv)
    sys.path.insert(0, REPO)
    global_batch = args.batch * RANKS
    per = args.per_identity
    identities = -(-(args.warmup + args.steps) * global_batch // per) + 1  # one epoch covers it
    started = time.time()
    images = make_images(os.path.join(args.workdir, f"images_{identities}x{per}"), identities,
                         per)
    from importlib.metadata import version
    doc = {"paddle": version("paddlepaddle"), "ranks": RANKS, "threads_per_rank": THREADS, "batch_per_rank": args.batch,
           "global_batch": global_batch, "warmup_steps": args.warmup, "timed_steps": args.steps,
           "repeats": args.repeats, "loader_workers_per_rank": args.workers,
           "plsc_grad_allreduce_dtype": args.grad_allreduce_dtype,
           "plsc_grad_sync": args.grad_sync or "default",
           "images": {"root": images, "identities": identities, "per_identity": per},
           "cpu": isa_cap.cpu(), "isa_caps": {cap: isa_cap.CAPS[cap] for cap in args.isa},
           "isa_probe": {cap: isa_cap.check(cap, args.torch_python, REPO) for cap in args.isa},
           "load_average_at_start": os.getloadavg(), "cases": {}}
    for name in args.cases:
        doc["cases"][name] = run_case(name, args, images)
    doc["load_average_at_end"] = os.getloadavg()
    doc["seconds"] = round(time.time() - started, 1)
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    if args.markdown:
        print(markdown(doc))


if __name__ == "__main__":
    main()
