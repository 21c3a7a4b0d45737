"""plsc's own CPU kernels against torch's, under each instruction-set cap: milliseconds of one
forward + backward of each kernel on ViT-T's and IResNet18's shapes (batch 32), one thread;
one JSON document.

    python benchmarks/benchmark_kernels_isa.py --torch-python /path/to/torchvenv/bin/python \\
        --isa avx2 native --rounds 3 --out kernels.json

Kernels (plsc's CPU kernel set; torch's ops of arcface_torch's layers):
- softmax over [32, 8, 144, 144] (ViT-T's attention scores): `plsc.models.rows.softmax_last`
  (oneDNN), `torch.softmax`;
- layernorm over [32, 144, 256]: `plsc.models.rows.LayerNorm` (oneDNN), `torch.nn.LayerNorm`;
- linear_relu6, [32, 144, 256] -> 1024: `plsc.models.linear_relu6` (GEMM, oneDNN's clip),
  `relu6(linear(x))`;
- residual_add of two [32, 144, 256]: `plsc.models.residual.residual_add` (numpy), `x + y`;
- split_heads of qkv [32, 144, 768] into 8 heads, q scaled: `plsc.models.heads.split_heads`
  (numpy copies), torch's reshape, permute, unbind and `q * scale` (views; the scale copies);
- prelu over [32, 64, 56, 56] (IResNet18's second stage, plain NCHW): `plsc.models.prelu`
  (oneDNN), `torch.nn.functional.prelu`.
The upstream gradients are random and fixed; best of --steps calls after 2 warm-ups. Each
(round, cap, side) is a fresh process started with the cap's environment
(benchmarks/isa_cap.py), the caps and sides alternated within each round; the figures are the
medians over rounds.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import isa_cap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"softmax": [32, 8, 144, 144], "layernorm": [32, 144, 256],
          "linear_relu6": [32, 144, 256], "residual_add": [32, 144, 256],
          "split_heads": [32, 144, 768], "prelu": [32, 64, 56, 56]}
HIDDEN, HEADS = 1024, 8


def _arrays(name):
    import numpy as np
    rng = np.random.default_rng(0)
    shape = SHAPES[name]
    x = rng.standard_normal(shape, dtype=np.float32)
    extra = {"linear_relu6": lambda: (rng.standard_normal((shape[-1], HIDDEN), dtype=np.float32)
                                      * 0.05, rng.standard_normal(HIDDEN, dtype=np.float32)),
             "layernorm": lambda: (),
             "residual_add": lambda: (rng.standard_normal(shape, dtype=np.float32),),
             "prelu": lambda: (np.full(shape[1], 0.25, np.float32),)}.get(name, lambda: ())()
    return x, extra


def _time(fn, steps):
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(1000 * best, 3)


def plsc_kernels(steps):
    sys.path.insert(0, REPO)
    import plsc  # noqa: F401  -- before Paddle (MKL's dispatch)
    import numpy as np
    import paddle
    from plsc.process import runtime
    runtime.select_device("cpu")
    from plsc.models.heads import split_heads
    from plsc.models.linear_relu6 import linear_relu6
    from plsc.models.prelu import prelu
    from plsc.models.residual import residual_add
    from plsc.models.rows import LayerNorm, softmax_last
    out = {}
    for name in SHAPES:
        x, extra = _arrays(name)
        xt = paddle.to_tensor(x, stop_gradient=False)
        ex = [paddle.to_tensor(a, stop_gradient=False) for a in extra]
        if name == "softmax":
            f = lambda: [softmax_last(xt)]  # noqa: E731
        elif name == "layernorm":
            ln = LayerNorm(SHAPES[name][-1])
            f = lambda: [ln(xt)]  # noqa: E731
        elif name == "linear_relu6":
            f = lambda: [linear_relu6(xt, ex[0], ex[1])]  # noqa: E731
        elif name == "residual_add":
            f = lambda: [residual_add(xt, ex[0])]  # noqa: E731
        elif name == "split_heads":
            f = lambda: list(split_heads(xt, HEADS, 32 ** -0.5))  # noqa: E731
        else:
            f = lambda: [prelu(xt, ex[0])]  # noqa: E731
        outs = f()
        grads = [paddle.to_tensor(np.random.default_rng(1).standard_normal(o.shape,
                                                                           dtype=np.float32))
                 for o in outs]

        def step():
            ys = f()
            paddle.autograd.backward(ys, grads)
            xt.clear_gradient(False)
            for t in ex:
                t.clear_gradient(False)
        out[name] = {"forward_ms": _time(f, steps), "forward_backward_ms": _time(step, steps)}
    return out


def torch_kernels(steps):
    import numpy as np
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = {}
    for name in SHAPES:
        x, extra = _arrays(name)
        xt = torch.from_numpy(x).requires_grad_()
        ex = [torch.from_numpy(a).requires_grad_() for a in extra]
        if name == "softmax":
            f = lambda: [torch.softmax(xt, -1)]  # noqa: E731
        elif name == "layernorm":
            ln = torch.nn.LayerNorm(SHAPES[name][-1])
            f = lambda: [ln(xt)]  # noqa: E731
        elif name == "linear_relu6":
            w = ex[0].detach().t().contiguous().requires_grad_()  # torch's [out, in]
            ex[0] = w
            f = lambda: [F.relu6(F.linear(xt, w, ex[1]))]  # noqa: E731
        elif name == "residual_add":
            f = lambda: [xt + ex[0]]  # noqa: E731
        elif name == "split_heads":
            def f():
                b, n, c = xt.shape
                q, k, v = xt.reshape(b, n, 3, HEADS, c // (3 * HEADS)).permute(2, 0, 3, 1, 4)
                return [q * 32 ** -0.5, k, v]
        else:
            f = lambda: [F.prelu(xt, ex[0])]  # noqa: E731
        grads = [torch.from_numpy(np.random.default_rng(1).standard_normal(tuple(o.shape),
                                                                           dtype=np.float32))
                 for o in f()]

        def step():
            torch.autograd.backward(f(), grads)
            for t in [xt] + ex:
                t.grad = None

        def fwd():
            with torch.no_grad():
                f()
        out[name] = {"forward_ms": _time(fwd, steps), "forward_backward_ms": _time(step, steps)}
    return out


def _worker(python, side, cap, steps):
    env = dict(isa_cap.cap_env(cap), OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run([python, os.path.abspath(__file__), "--worker", side, "--steps",
                           str(steps)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=REPO)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"{side} worker ({cap}) exit {proc.returncode}: {proc.stderr[-800:]}")
    return json.loads(lines[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", nargs="+", default=["avx2", "native"], choices=list(isa_cap.CAPS))
    p.add_argument("--torch-python", help="a Python with torch: its side; else plsc only")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed calls (the best is kept)")
    p.add_argument("--out")
    p.add_argument("--worker", choices=("plsc", "torch"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        fn = plsc_kernels if args.worker == "plsc" else torch_kernels
        print(json.dumps(fn(args.steps)), flush=True)
        return 0
    sides = {"plsc": sys.executable}
    if args.torch_python:
        sides["torch"] = args.torch_python
    raw = {(c, s): [] for c in args.isa for s in sides}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for cap in args.isa:
            for side, python in sides.items():
                raw[cap, side].append(_worker(python, side, cap, args.steps))
    load.append(os.getloadavg()[0])
    table = {}
    for name in SHAPES:
        row = {}
        for (cap, side), runs in raw.items():
            for key in ("forward_ms", "forward_backward_ms"):
                row[f"{side}_{cap}_{key}"] = statistics.median(r[name][key] for r in runs)
        for cap in args.isa:
            if "torch" in sides:
                row[f"plsc_over_torch_{cap}"] = round(row[f"plsc_{cap}_forward_backward_ms"]
                                                      / row[f"torch_{cap}_forward_backward_ms"], 3)
        if "avx2" in args.isa and "native" in args.isa:
            for side in sides:
                row[f"{side}_avx2_over_native"] = round(
                    row[f"{side}_avx2_forward_backward_ms"]
                    / row[f"{side}_native_forward_backward_ms"], 3)
        table[name] = row
    doc = {"benchmark": "kernels_isa", "shapes": SHAPES, "threads": 1, "rounds": args.rounds,
           "cpu": isa_cap.cpu(), "isa_caps": {c: isa_cap.CAPS[c] for c in args.isa},
           "load_avg_1m": load, "kernels": table, "raw": {f"{c}/{s}": v for (c, s), v in
                                                            raw.items()}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
