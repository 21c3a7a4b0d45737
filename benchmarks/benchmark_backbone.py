"""Is a plsc backbone's training step as fast as arcface_torch's? Seconds of one step of r18,
r50, MobileFaceNet (mbf) and vit_t in plsc, set up as a run sets it up and as a hand-written
loop, beside the same architecture in arcface_torch (PyTorch); one JSON document.

    python benchmarks/benchmark_backbone.py                         # plsc only: torch "not run"
    python benchmarks/benchmark_backbone.py --torch-python /path/to/torchvenv/bin/python \\
        --arcface-torch /path/to/insightface/recognition/arcface_torch --out backbone.json
    python benchmarks/benchmark_backbone.py --backbones r18 mbf --batch 8 --steps 2
    python benchmarks/benchmark_backbone.py --profile --backbones r50 \\
        --torch-python /path/to/torchvenv/bin/python --arcface-torch DIR   # time per op kind

One step is forward, backward and a momentum-SGD update (lr 0.1, momentum 0.9, weight decay
5e-4: `paddle.optimizer.Momentum`, `torch.optim.SGD`) of a batch of `--batch` random
112 x 112 images (numpy seed 0, the same images in both frameworks; framework seed 0), with
the loss the mean of the squared 512-d embedding. (A loss linear in the embedding, its plain
mean, would give every layer below the embedding's closing BatchNorm a zero gradient up to
rounding: the same kernels, but tiny and denormal values that are no training step's.) The
gradients are freed after the update (`clear_grad(set_to_zero=False)`, `zero_grad()`), as
the trainer does. Reported: the best (min) of `--steps` steps after `--warmup` steps.

Each measurement runs in its own fresh process (threads, MKL dispatch and allocator state do
not leak from one to the next), this script started again with `--worker KIND`:
- plsc_run: `import plsc` first, then `plsc.process.runtime.select_device("cpu")`, the CPU set-up a
  run does (`plsc.process.runtime.start`): threads by plsc's rule (`set_cpu_threads`) and malloc
  keeping freed memory (`keep_freed_memory`); then `build_model(name)`.
- plsc_loop: a user's own loop: `import plsc`, `from plsc.models import build_model`, nothing
  else (building the model applies plsc's thread rule, `plsc.process.cpu_setup.ensure`).
- torch: `--torch-python`'s interpreter with torch's default threads, the model from
  arcface_torch's own source: `backbones.get_model(name, num_features=512)` imported from the
  directory `--arcface-torch` (holding arcface_torch's `backbones/` package). Its vit.py imports
  timm (DropPath, to_2tuple, trunc_normal_); without timm a stand-in defined here is used
  (timm's per-sample drop path scaled by 1/keep, `torch.nn.init.trunc_normal_`) and the
  output says "timm": "stand-in". torch and arcface_torch are never plsc's dependencies: they
  are only run here, in that subprocess.
Every environment variable reaches all three: `OMP_NUM_THREADS` sets torch's threads and, by
plsc's rule, plsc's. A busy machine hurts torch most: its OpenMP runtime (libgomp) spins while
a thread waits, and a core taken by another process stalls every op (on this project's 2-core
machine while other jobs ran, 1-minute load about 2: arcface_torch's r18 step at batch 4 took
4.2 s with 2 threads, 0.6 s with 1 or with `OMP_WAIT_POLICY=passive`); each measurement
records the 1-minute load average when it starts and the OpenMP variables set. Measure on an
idle machine.
`--isa` caps the instruction set of all three workers alike (benchmarks/isa_cap.py: oneDNN,
MKL, numpy, OpenBLAS and ATen at AVX2 with `avx2`; none of those variables with `native`);
several caps give one row each per backbone, the workers alternated cap by cap. The document
carries the CPU's SIMD flags, each cap's variables and a probe of what oneDNN, numpy and ATen
run under it, for both interpreters.
The threads each used are read from the process: Paddle's from the OpenMP runtime it bundles
(omp_get_max_threads of paddle/libs/libiomp5.so, through ctypes), plsc's own kernels'
(`plsc.process.runtime.kernel_threads`), torch's `torch.get_num_threads()`.

`--profile` (one backbone, the first of `--backbones`) times one step after the warm-up
under Paddle's profiler (plsc_run's set-up) and torch.profiler, each op counted once at the
outermost op event (a backward node as a whole; plsc's layers whose forward is a PyLayer,
Conv2D, Linear, LayerNorm and PReLU, as a whole layer, since their oneDNN or numpy work is no
Paddle op) and grouped: conv2d (depthwise too), conv2d_grad, batch_norm, batch_norm_grad,
prelu, prelu_grad, matmul_linear (matmul, linear, addmm, mm, bmm, forward and backward),
optimizer (the whole update: Paddle's "Optimization Step", torch's SGD.step), other_ops
(every other op; its largest kinds in other_top), outside_ops (the step's time outside any op:
Python, the autograd engine, and plsc's softmax and permute, which are PyLayers but no layers)
and step_s (the profiled step's wall time, profiler overhead included).
"""
import argparse
import json
import os
import subprocess
import sys
import time

import isa_cap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKBONES = ("r18", "r50", "mbf", "vit_t")
IMAGE_SIZE = 112
EMBEDDING = 512
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-4


def _images(batch):
    import numpy as np
    return np.random.RandomState(0).standard_normal(
        (batch, 3, IMAGE_SIZE, IMAGE_SIZE)).astype("float32")


def _measure(result, step, warmup, steps, profiler=None):
    """`result` with this process's notes and either the times of `steps` steps after `warmup`
    (`times_s`) or, given a `profiler`, its profile of one step after the warm-up."""
    result.update(_process_notes())
    if profiler is not None:
        _time_steps(step, warmup, 0)
        result["profile"] = profiler(step)
    else:
        result["times_s"] = [round(t, 5) for t in _time_steps(step, warmup, steps)]
    return result


def _time_steps(step, warmup, steps):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def _op_name(name):
    """An op event's name without its framework's wrapping: Paddle's "conv2d dygraph",
    "Global_Conv2dGradNodeFinal", torch's "autograd::engine::evaluate_function: AddBackward0"."""
    name = name.replace("autograd::engine::evaluate_function: ", "").replace("Global_", "")
    return name.split()[0] if name.split() else name


def _group(name):
    """The op kind (see the module's doc) of a Paddle or torch op event's name, None: other."""
    n = _op_name(name).lower()
    grad = "backward" in n or "gradnode" in n or n.endswith("_grad")
    n = n.replace("_", "")
    if "conv2d" in n or "convolution" in n:  # depthwise_conv2d, aten::convolution too
        return "conv2d_grad" if grad else "conv2d"
    if "batchnorm" in n:
        return "batch_norm_grad" if grad else "batch_norm"
    if "prelu" in n:
        return "prelu_grad" if grad else "prelu"
    if any(k in n for k in ("matmul", "linear", "addmm", "bmm")) or n in ("aten::mm",
                                                                          "mmbackward0"):
        return "matmul_linear"
    return None


def _process_notes():
    """What else decides a measurement's time: the machine's load when it starts, and the
    OpenMP settings of the environment (both frameworks' runtimes read them)."""
    keys = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT")
    try:  # the environment the process started with (importing Paddle writes OMP_NUM_THREADS)
        with open("/proc/self/environ", "rb") as f:
            pairs = (item.decode(errors="replace").partition("=")
                     for item in f.read().split(b"\0") if b"=" in item)
            start = {key: value for key, _, value in pairs}
    except OSError:
        start = dict(os.environ)
    return {"load_avg_1m": round(os.getloadavg()[0], 2),
            "omp_env": {k: start[k] for k in keys if k in start}}


def _summarise(units, wall_s):
    """{group: seconds} from (name, group or None, seconds) of the outermost op events."""
    out = {g: 0.0 for g in ("conv2d", "conv2d_grad", "batch_norm", "batch_norm_grad", "prelu",
                            "prelu_grad", "matmul_linear", "optimizer", "other_ops")}
    other = {}
    for name, group, seconds in units:
        out[group or "other_ops"] += seconds
        if group is None:
            key = _op_name(name)
            other[key] = other.get(key, 0.0) + seconds
    out["outside_ops"] = wall_s - sum(out.values())
    out["step_s"] = wall_s
    out = {k: round(v, 5) for k, v in out.items()}
    out["other_top"] = {k: round(v, 5) for k, v in
                        sorted(other.items(), key=lambda kv: -kv[1])[:6]}
    return out


# --------------------------------------------------------------------------- plsc workers

def _paddle_omp_threads():
    """omp_get_max_threads() of the OpenMP runtime Paddle bundles, or None."""
    import ctypes
    import paddle
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(paddle.__file__), "libs", "libiomp5.so"),
                          mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        return int(lib.omp_get_max_threads())
    except (OSError, AttributeError):
        return None


_PYLAYER_LAYERS = ("PReLU", "Conv2D", "Linear", "LayerNorm")


def _paddle_profile(step):
    import paddle.profiler as profiler
    kinds = profiler.TracerEventType
    prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], on_trace_ready=lambda p: None)
    prof.start()
    start = time.perf_counter()
    step()
    wall = time.perf_counter() - start
    prof.stop()
    units = []

    def walk(node):
        for child in node.children_node:
            seconds = (child.end_ns - child.start_ns) / 1e9
            if child.type == kinds.Optimization:
                units.append((child.name, "optimizer", seconds))
            elif child.type == kinds.Forward and child.name in _PYLAYER_LAYERS:
                # plsc's layers whose forward is a PyLayer (their backward is a grad node): the
                # layer as a whole, or the oneDNN / numpy work in it would count as outside ops
                units.append((child.name, _group(child.name), seconds))
            elif child.type == kinds.Operator:  # outermost op (a grad node as a whole)
                units.append((child.name, _group(child.name), seconds))
            else:
                walk(child)
    for root in prof.profiler_result.get_data().values():
        walk(root)
    return _summarise(units, wall)


def plsc_worker(kind, name, batch, warmup, steps, profile):
    sys.path.insert(0, REPO)
    import plsc  # noqa: F401  -- first: sets MKL's dispatch before Paddle loads
    setup = None
    if kind == "plsc_run":
        from plsc.process import cpu_setup, runtime
        runtime.select_device("cpu")
        setup = [cpu_setup.NOTE, cpu_setup.MALLOC_NOTE]
    from plsc.models import build_model
    import paddle
    from plsc.process import runtime

    paddle.seed(0)
    model = build_model(name, embedding_size=EMBEDDING, input_size=(IMAGE_SIZE, IMAGE_SIZE))
    model.train()
    opt = paddle.optimizer.Momentum(learning_rate=LR, momentum=MOMENTUM,
                                    weight_decay=WEIGHT_DECAY, parameters=model.parameters())
    x = paddle.to_tensor(_images(batch))

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
    result = {"kind": kind, "backbone": name, "model": type(model).__name__,
              "parameters": int(sum(p.size for p in model.parameters())),
              "paddle": paddle.__version__, "paddle_threads": _paddle_omp_threads(),
              "plsc_kernel_threads": runtime.kernel_threads(),
              "cpu": runtime.cpu_description(), "setup": setup,
              "MKL_DEBUG_CPU_TYPE": os.environ.get("MKL_DEBUG_CPU_TYPE")}
    return _measure(result, step, warmup, steps, _paddle_profile if profile else None)


# --------------------------------------------------------------------------- torch worker

def _timm_stand_in():
    """timm.models.layers' DropPath, to_2tuple and trunc_normal_ for arcface_torch's vit.py
    when timm is not installed: sys.modules entries, nothing written to disk."""
    import collections.abc
    import types

    import torch
    from torch import nn

    class DropPath(nn.Module):  # per-sample stochastic depth, kept paths scaled by 1/keep
        def __init__(self, drop_prob=0.0, scale_by_keep=True):
            super().__init__()
            self.drop_prob, self.scale_by_keep = drop_prob, scale_by_keep

        def forward(self, x):
            if self.drop_prob == 0.0 or not self.training:
                return x
            keep = 1.0 - self.drop_prob
            mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
            return x * (mask / keep if self.scale_by_keep else mask)

    def to_2tuple(x):
        return tuple(x) if isinstance(x, collections.abc.Iterable) else (x, x)

    layers = types.ModuleType("timm.models.layers")
    layers.DropPath, layers.to_2tuple = DropPath, to_2tuple
    layers.trunc_normal_ = torch.nn.init.trunc_normal_
    models = types.ModuleType("timm.models")
    models.layers = layers
    timm = types.ModuleType("timm")
    timm.models = models
    sys.modules.update({"timm": timm, "timm.models": models, "timm.models.layers": layers})


def _torch_profile(step):
    import torch.profiler as tp
    with tp.profile(activities=[tp.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    units = []
    for event in prof.events():
        if event.cpu_parent is not None:
            continue  # inside an outer op: counted there
        seconds = event.time_range.elapsed_us() / 1e6
        if event.name.startswith("Optimizer.step"):
            units.append((event.name, "optimizer", seconds))
        elif event.name.startswith("Optimizer.zero_grad"):
            units.append((event.name, None, seconds))
        else:
            units.append((event.name, _group(event.name), seconds))
    return _summarise(units, wall)


def torch_worker(name, batch, warmup, steps, profile, arcface_dir):
    import warnings
    warnings.filterwarnings("ignore")  # arcface_torch's torch.cuda.amp.autocast(False) etc.
    import torch
    try:
        import timm.models.layers  # noqa: F401
        timm_used = __import__("timm").__version__
    except ImportError:
        _timm_stand_in()
        timm_used = "stand-in"
    sys.path.insert(0, os.path.abspath(arcface_dir))
    from backbones import get_model

    torch.manual_seed(0)
    model = get_model(name, num_features=EMBEDDING)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                          weight_decay=WEIGHT_DECAY)
    x = torch.from_numpy(_images(batch))

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    result = {"kind": "torch", "backbone": name, "model": type(model).__name__,
              "parameters": int(sum(p.numel() for p in model.parameters())),
              "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
              "timm": timm_used, "arcface_torch": os.path.abspath(arcface_dir)}
    return _measure(result, step, warmup, steps, _torch_profile if profile else None)


# --------------------------------------------------------------------------- main

def _run_worker(python, kind, name, args, cap):
    cmd = [python, os.path.abspath(__file__), "--worker", kind, "--backbones", name,
           "--batch", str(args.batch), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    if kind == "torch":
        cmd += ["--arcface-torch", args.arcface_torch]
    if args.profile:
        cmd.append("--profile")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=REPO, env=isa_cap.cap_env(cap))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"kind": kind, "backbone": name, "isa_cap": cap, "error": f"exit {proc.returncode}",
                "stderr_tail": tail}
    return dict(json.loads(lines[-1]), isa_cap=cap)


def _best(result):
    return min(result["times_s"]) if "times_s" in result else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbones", nargs="+", default=list(BACKBONES),
                        help="plsc / arcface_torch names (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=32, help="images per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (the best is kept)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--torch-python", help="a Python interpreter that has torch (and "
                        "numpy): runs arcface_torch's backbones; without it torch is not run")
    parser.add_argument("--arcface-torch", help="arcface_torch's directory (holding its "
                        "backbones/ package); needed with --torch-python")
    parser.add_argument("--profile", action="store_true",
                        help="time per op kind of one step of the first backbone")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--isa", nargs="+", default=["native"], choices=list(isa_cap.CAPS),
                        help="instruction-set cap(s) of every worker (benchmarks/isa_cap.py; "
                        "default: native)")
    parser.add_argument("--worker", choices=["plsc_run", "plsc_loop", "torch"],
                        help=argparse.SUPPRESS)  # one measurement, in this fresh process
    args = parser.parse_args(argv)

    if args.worker:
        name = args.backbones[0]
        if args.worker == "torch":
            result = torch_worker(name, args.batch, args.warmup, args.steps, args.profile,
                                  args.arcface_torch)
        else:
            result = plsc_worker(args.worker, name, args.batch, args.warmup, args.steps,
                                 args.profile)
        print(json.dumps(result), flush=True)
        return 0

    if args.torch_python and not args.arcface_torch:
        parser.error("--torch-python needs --arcface-torch DIR (arcface_torch's directory)")
    if args.arcface_torch and not os.path.isdir(os.path.join(args.arcface_torch, "backbones")):
        parser.error(f"--arcface-torch {args.arcface_torch}: no backbones/ in it")
    torch_on = bool(args.torch_python)
    report = {"benchmark": "backbone", "batch": args.batch, "image_size": IMAGE_SIZE,
              "embedding_size": EMBEDDING, "warmup": args.warmup, "steps": args.steps,
              "load_avg_1m_start": round(os.getloadavg()[0], 2),
              "cpu_simd": isa_cap.cpu(), "isa_caps": {c: isa_cap.CAPS[c] for c in args.isa},
              "isa_probe": {c: isa_cap.check(c, args.torch_python, REPO) for c in args.isa}}

    if args.profile:
        name, cap = args.backbones[0], args.isa[0]
        prof = {"plsc": _run_worker(sys.executable, "plsc_run", name, args, cap)}
        prof["torch"] = (_run_worker(args.torch_python, "torch", name, args, cap) if torch_on
                         else "not run")
        report["isa_cap"] = cap
        report.update(backbone=name, profile={
            side: (r.get("profile", r) if isinstance(r, dict) else r) for side, r in prof.items()})
        report["paddle"] = prof["plsc"].get("paddle")
        report["paddle_threads"] = prof["plsc"].get("paddle_threads")
        report["cpu"] = prof["plsc"].get("cpu")
        if torch_on:
            report["torch"] = prof["torch"].get("torch")
            report["torch_threads"] = prof["torch"].get("torch_threads")
    else:
        rows, raw = [], []
        for name, cap in [(n, c) for n in args.backbones for c in args.isa]:
            run = _run_worker(sys.executable, "plsc_run", name, args, cap)
            loop = _run_worker(sys.executable, "plsc_loop", name, args, cap)
            tor = (_run_worker(args.torch_python, "torch", name, args, cap) if torch_on
                   else None)
            raw += [r for r in (run, loop, tor) if r is not None]
            run_s, loop_s = _best(run), _best(loop)
            torch_s = _best(tor) if tor else "not run"

            def ratio(s):
                if not tor:
                    return "not run"
                return round(s / torch_s, 3) if s and torch_s else None
            rows.append({
                "backbone": name, "isa_cap": cap, "plsc_run_s": run_s, "plsc_loop_s": loop_s,
                "torch_s": torch_s, "ratio_run": ratio(run_s), "ratio_loop": ratio(loop_s),
                "threads": {"plsc_run": run.get("paddle_threads"),
                            "plsc_loop": loop.get("paddle_threads"),
                            "plsc_kernels_run": run.get("plsc_kernel_threads"),
                            "plsc_kernels_loop": loop.get("plsc_kernel_threads"),
                            "torch": tor.get("torch_threads") if tor else "not run"},
                "parameters": {"plsc": run.get("parameters"),
                               "torch": tor.get("parameters") if tor else "not run"}})
        first = next((r for r in raw if r.get("kind") == "plsc_run" and "cpu" in r), {})
        first_torch = next((r for r in raw if r.get("kind") == "torch" and "torch" in r), {})
        report.update(cpu=first.get("cpu"), paddle=first.get("paddle"),
                      torch=first_torch.get("torch", "not run"),
                      timm=first_torch.get("timm", "not run"),
                      plsc_run_setup=first.get("setup"),
                      MKL_DEBUG_CPU_TYPE=first.get("MKL_DEBUG_CPU_TYPE"),
                      rows=rows, measurements=raw)
    report["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
