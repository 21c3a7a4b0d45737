"""Time writing and reading a chunk of 8- and 4-bit optimizer state on the CPU kernel set.

    python benchmarks/benchmark_state_codes.py --rows 1024 --dim 512 --rounds 30

A write is `quantize` of a `[rows, dim]` float32 chunk with stochastic-rounding noise (as
the optimizers write state), a read is `dequantize` of the codes back to float32, for each
map: "int8" (linear), "int8_log", "uint8_log" (`plsc.storage.int8`), "int4" (linear),
"int4_log", "uint4_log" (`plsc.storage.int4`). Every round runs each once (a drift of the
machine's speed hits all alike); medians reported, of the wall time and of the thread's CPU time (which leaves out the
time other processes held the core). One kernel thread, malloc as a training run keeps it.
Prints JSON: milliseconds, and the ratios to the linear int8 map's.
"""
import argparse
import json
import statistics
import time

import plsc  # noqa: F401  -- before Paddle: MKL's dispatch on AMD processors
import numpy as np
import paddle

from plsc.process import cpu_setup

from plsc.storage import int8 as quantized, int4 as quantized4

MAPS = {"int8": quantized, "int8_log": quantized, "uint8_log": quantized,
        "int4": quantized4, "int4_log": quantized4, "uint4_log": quantized4}


def cases(rows, dim, seed):
    """{(op, map): fn}: writes with noise and reads of state-like values (magnitudes spread
    over a few octaves within a row; non-negative for the unsigned maps)."""
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(rows, dim)) * np.exp(rng.uniform(-4, 0, (rows, dim)))
    signed = paddle.to_tensor(x.astype(np.float32))
    positive = paddle.to_tensor(np.abs(x).astype(np.float32))
    noise = paddle.to_tensor(rng.uniform(size=(rows, dim)).astype(np.float32))
    out = {}
    for name, mod in MAPS.items():
        v = positive if name.startswith("u") else signed
        codes, scale = mod.quantize(v, name, noise)
        out["write", name] = lambda mod=mod, v=v, name=name: mod.quantize(v, name, noise)
        out["read", name] = lambda mod=mod, c=codes, s=scale, name=name: \
            mod.dequantize(c, s, name)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    paddle.set_device("cpu")
    cpu_setup.keep_freed_memory()
    fns = cases(args.rows, args.dim, args.seed)
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(args.rounds):
        for key, fn in fns.items():
            t, c = time.perf_counter(), time.thread_time()
            fn()
            cpu[key].append(time.thread_time() - c)
            wall[key].append(time.perf_counter() - t)
    ms = {f"{op} {name}": {"wall_ms": round(statistics.median(wall[op, name]) * 1e3, 3),
                           "cpu_ms": round(statistics.median(cpu[op, name]) * 1e3, 3)}
          for op, name in fns}
    for key, value in ms.items():
        base = ms[key.split()[0] + " int8"]
        value["cpu_ratio_to_int8"] = round(value["cpu_ms"] / base["cpu_ms"], 2)
    print(json.dumps({"rows": args.rows, "dim": args.dim, "rounds": args.rounds,
                      "paddle": paddle.__version__, "times": ms}, indent=1))


if __name__ == "__main__":
    main()
