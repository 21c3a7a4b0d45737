"""The instruction-set caps the benchmarks apply to both sides alike, the CPU's SIMD flags,
and a probe of what each library then runs (imported by benchmark_train.py and
benchmark_backbone.py; `python benchmarks/isa_cap.py --check [--torch-python PY]` prints the
probe under each cap).

A cap is a set of environment variables read by the libraries as they load, so it is given to
the child processes (the ranks, the workers), never set in a process that has loaded them:
- oneDNN (Paddle's bundled libdnnl, which plsc's convolutions, softmax and LayerNorm run, and
  torch's): ONEDNN_MAX_CPU_ISA (DNNL_MAX_CPU_ISA for older builds);
- MKL (Paddle's matmul, torch's GEMMs): MKL_ENABLE_INSTRUCTIONS;
- numpy's dispatched SIMD loops (plsc's element-wise kernels): NPY_DISABLE_CPU_FEATURES, the
  AVX-512 targets under numpy 2 names (X86_V4, AVX512_ICL, AVX512_SPR) and numpy 1 names;
- numpy's OpenBLAS (numpy matmuls): OPENBLAS_CORETYPE;
- torch's ATen kernels: ATEN_CPU_CAPABILITY.
"native" sets none of them and removes any inherited one, so a run says what it ran.
"""
import json
import os
import re
import subprocess
import sys

_NPY_AVX512 = ("X86_V4 AVX512_ICL AVX512_SPR "  # numpy >= 2.4's dispatch targets
               "AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL")
CAPS = {
    "native": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "NPY_DISABLE_CPU_FEATURES": _NPY_AVX512,
             "OPENBLAS_CORETYPE": "Haswell", "ATEN_CPU_CAPABILITY": "avx2"},
}
CAP_VARIABLES = sorted({k for env in CAPS.values() for k in env})
_SIMD = re.compile(r"^(sse4_2|avx\w*|fma|f16c|amx\w*)$")


def cap_env(cap, env=None):
    """`env` (default os.environ) with cap `cap`'s variables set and every other cap
    variable removed."""
    out = {k: v for k, v in (os.environ if env is None else env).items()
           if k not in CAP_VARIABLES}
    out.update(CAPS[cap])
    return out


def cpu():
    """The CPU's model name and SIMD flags (/proc/cpuinfo's first processor)."""
    model, flags = None, []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key == "flags":
                    flags = sorted(x for x in value.split() if _SIMD.match(x))
                    break
    except OSError:
        pass
    return {"model": model, "simd_flags": flags, "avx512": any(f.startswith("avx512")
                                                              for f in flags)}


def describe(cap):
    """What a benchmark's JSON carries beside its figures: the cap, its variables, the CPU."""
    return {"isa_cap": cap, "isa_cap_env": CAPS[cap], "cpu": cpu()}


# ------------------------------------------------------------------------------ probe
def _probe_work(side):
    """One small convolution and one GEMM on `side`'s libraries (so oneDNN and MKL print
    their verbose ISA lines), and numpy's and torch's own dispatch as they report it."""
    import numpy as np
    out = {"side": side}
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:  # numpy 1
        from numpy.core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    out["numpy_dispatch"] = [t for t in __cpu_dispatch__ if __cpu_features__.get(t)]
    x = np.random.default_rng(0).standard_normal((2, 16, 8, 8), dtype=np.float32)
    w = np.random.default_rng(1).standard_normal((16, 16, 3, 3), dtype=np.float32)
    a = np.ones((256, 256), np.float32)
    if side == "torch":
        import torch
        out["aten_capability"] = torch.backends.cpu.get_cpu_capability()
        torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), padding=1)
        torch.from_numpy(a) @ torch.from_numpy(a)
    else:
        import paddle
        from plsc.models.conv import Conv2D
        conv = Conv2D(16, 16, 3, padding=1, bias_attr=False)
        conv(paddle.to_tensor(x))  # plsc's oneDNN convolution (Paddle's libdnnl)
        paddle.matmul(paddle.to_tensor(a), paddle.to_tensor(a))
    return out


def probe(python, side, env, repo):
    """Run the probe under `python` with `env` (a cap's) and the libraries' verbose flags;
    what numpy, ATen, oneDNN and MKL report they run."""
    env = dict(env, ONEDNN_VERBOSE="1", DNNL_VERBOSE="1", MKL_VERBOSE="1", PYTHONPATH=repo)
    proc = subprocess.run([python, os.path.abspath(__file__), "--probe-side", side], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=repo)
    lines = proc.stdout.splitlines()
    found = [json.loads(x) for x in lines if x.startswith("{")]
    out = found[-1] if found else {"side": side, "error": f"exit {proc.returncode}: "
                                   + " ".join(lines[-3:])[:300]}
    isa = [x.split("isa:", 1)[1].strip() for x in lines if "info,cpu,isa:" in x]
    out["onednn_isa"] = isa[0] if isa else None
    # MKL's first verbose line names the ISA it dispatches to on Intel CPUs only ("... Intel(R)
    # AVX2 enabled processors"); on AMD it says "Intel(R) Architecture processors" either way
    mkl = [x[len("MKL_VERBOSE"):].strip() for x in lines
           if x.startswith("MKL_VERBOSE") and "processors" in x]
    out["mkl"] = mkl[0] if mkl else None
    return out


def check(cap, torch_python=None, repo=None):
    """The probe of both sides under `cap`."""
    repo = repo or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = cap_env(cap)
    out = {"plsc": probe(sys.executable, "paddle", env, repo)}
    if torch_python:
        out["torch"] = probe(torch_python, "torch", env, repo)
    return out


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="probe both caps, print JSON")
    p.add_argument("--torch-python", help="also probe this torch interpreter")
    p.add_argument("--probe-side", choices=("paddle", "torch"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe_side:
        print(json.dumps(_probe_work(args.probe_side)), flush=True)
        return 0
    print(json.dumps({"cpu": cpu(), **{cap: check(cap, args.torch_python) for cap in CAPS}},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
