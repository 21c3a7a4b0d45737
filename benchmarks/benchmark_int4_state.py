"""Which 4-bit map and block size suit the head's optimizer state: quantises real momentum and
moment rows with each candidate and prints JSON.

The rows come from a training run: a PartialFC head (int8 centres, d = 512) trained by itself
on fixed embeddings as in `benchmarks/benchmark_int8_state.py` (each class a random unit
direction, its samples that direction plus noise), with SGD-momentum and with AdamW, optimizer
state in float32. After the run, the rows that were ever written (the state of every sampled
class) are quantised in float64 numpy with each candidate map (16 codes) and block size (values
sharing one scale, their largest magnitude), rounded to nearest. Reported per candidate:
- `rel_rms`: ||q(x) − x|| / ||x|| over all rows (nearest rounding);
- `rel_rms_sr`: the same for stochastic rounding, in expectation ((y − lo)(hi − y) per value);
- `zeroed`: the fraction of nonzero values rounded to 0 (nearest);
- for AdamW's second moment `update_rel_rms`: the error of the update m / (√v + ε) with v
  quantised (m exact), `update_max_ratio`: the largest |update| over the exact one's largest,
  and `zero_of_positive`: the fraction of positive values a map without the zero-point rule
  would store as 0 (the rule stores them as the smallest step).
`--train` also trains the head with plsc's 4-bit state (float32, int8 and int4 state side by
side: final loss, centres' top-1, largest step), as benchmark_int8_state.py did for 8 bits.

    python benchmarks/benchmark_int4_state.py --steps 200 [--train]
"""
import argparse
import json
import sys
import time

import numpy as np

from benchmark_int8_state import make_data, run  # the same head, data and training loop
from plsc.storage import read as rows_f32

BLOCKS = (32, 64, 128, 256, 512)


def signed_log(octaves):
    """0 and ±2^(−k·octaves), k = 0 … 6 (15 codes)."""
    mags = 2.0 ** (-np.arange(7) * octaves)
    return np.concatenate([-mags, [0.0], mags[::-1]])


def unsigned_log(octaves):
    """0 and 2^(−k·octaves), k = 0 … 14 (16 codes)."""
    return np.concatenate([[0.0], (2.0 ** (-np.arange(15) * octaves))[::-1]])


def dynamic_exponent():
    """Li et al.'s signed dynamic-exponent map at 4 bits (sign, then leading zeros as the
    exponent, the remaining bits a linear fraction), normalised to [-1, 1]."""
    pos = []
    for e in range(3):  # 3 magnitude bits: exponent e zeros, then a 1, then fraction bits
        frac_bits = 2 - e
        for f in range(2 ** frac_bits):
            pos.append(10.0 ** (-e) * (0.1 + 0.9 * (f + 1) / 2 ** frac_bits))
    pos = np.unique(np.array(pos))
    return np.concatenate([-pos[::-1], [0.0], pos])


SIGNED = {"linear (c/7)": np.arange(-7, 8) / 7.0,
          "log, octaves (±2^-k, k < 7)": signed_log(1.0),
          "log, half octaves (±2^-k/2, k < 7): int4_log": signed_log(0.5),
          "dynamic exponent (Li et al.)": dynamic_exponent()}
UNSIGNED = {"linear (c/15)": np.arange(16) / 15.0,
            "linear without 0 ((c+1)/16)": (np.arange(16) + 1) / 16.0,
            "log, octaves (2^-k, k < 15)": unsigned_log(1.0),
            "log, two octaves (2^-2k, k < 15)": unsigned_log(2.0),
            "log, half octaves (2^-k/2, k < 15): uint4_log": unsigned_log(0.5)}


def quantise(x, table, block, zero_rule=True):
    """(nearest, expected squared error of a stochastic write) of float64 rows `x` ([n, d])
    under `table` (ascending, values in [-1, 1]) with one scale (max |x|) per `block` values."""
    n, d = x.shape
    xb = x.reshape(n, d // block, block)
    scale = np.abs(xb).max(axis=2, keepdims=True)
    y = xb / np.where(scale > 0, scale, 1)
    hi = np.clip(np.searchsorted(table, y, side="right"), 1, len(table) - 1)
    lo, up = table[hi - 1], table[hi]
    near = np.where(y - lo > up - y, up, lo)
    sq = (y - lo) * (up - y)  # E (stored - y)^2 of a stochastic write between lo and up
    below = y < table[0]  # a map without 0: the smallest value, always
    near = np.where(below, table[0], near)
    sq = np.where(below, (table[0] - y) ** 2, sq)
    if zero_rule and table[0] == 0:  # a positive value is stored as the smallest step
        small = (y > 0) & (y < table[1])
        near = np.where(small, table[1], near)
        sq = np.where(small, (table[1] - y) ** 2, sq)
    return (near * scale).reshape(n, d), (sq * scale ** 2).reshape(n, d)


def errors(x, table, block):
    q, sq = quantise(x, table, block)
    norm = np.linalg.norm(x)
    return {"rel_rms": float(np.linalg.norm(q - x) / norm),
            "rel_rms_sr": float(np.sqrt(sq.sum()) / norm),
            "zeroed": float(((q == 0) & (x != 0)).sum() / max(1, (x != 0).sum()))}


def state_rows(opt, key):
    """float64 rows of state `key` of the weight that were ever written (nonzero)."""
    x = rows_f32(opt._state["weight"][key]).numpy().astype(np.float64)
    return x[np.abs(x).max(axis=1) > 0]


def measure(args, data):
    out = {}
    _, sgd = run(args, "sgd", "float32", None, data)
    _, adamw = run(args, "adamw", "float32", None, data)
    v1 = state_rows(sgd, "velocity")
    m, v = state_rows(adamw, "moment1"), state_rows(adamw, "moment2")
    out["rows"] = {"velocity": len(v1), "moment1": len(m), "moment2": len(v)}
    for key, x in (("velocity", v1), ("moment1", m)):
        out[key] = {name: {b: errors(x, t, b) for b in BLOCKS} for name, t in SIGNED.items()}
    eps = 1e-8
    exact = m / (np.sqrt(v) + eps)
    out["moment2"] = {}
    for name, t in UNSIGNED.items():
        out["moment2"][name] = {}
        for b in BLOCKS:
            q, _ = quantise(v, t, b)
            q_no_rule, _ = quantise(v, t, b, zero_rule=False)
            upd = m / (np.sqrt(q) + eps)
            out["moment2"][name][b] = dict(
                errors(v, t, b),
                update_rel_rms=float(np.linalg.norm(upd - exact) / np.linalg.norm(exact)),
                update_max_ratio=float(np.abs(upd).max() / np.abs(exact).max()),
                zero_of_positive=float(((q_no_rule == 0) & (v > 0)).sum() / (v > 0).sum()))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ratio", type=float, default=0.3, help="Partial FC sample ratio")
    p.add_argument("--noise", type=float, default=1.0, help="sample noise (norm, relative)")
    p.add_argument("--lr-adamw", type=float, default=0.01)
    p.add_argument("--lr-sgd", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", action="store_true",
                   help="also train with float32, int8 and int4 state and compare")
    args = p.parse_args()
    data = make_data(args)
    start = time.perf_counter()
    out = {"args": vars(args), "errors": measure(args, data)}
    out["errors_seconds"] = round(time.perf_counter() - start, 1)
    if args.train:
        out["runs"] = []
        for kind in ("sgd", "adamw"):
            for state_dtype in ("float32", "int8", "int4"):
                start = time.perf_counter()
                result, _ = run(args, kind, state_dtype, None, data)
                out["runs"].append(dict(optimizer=kind, state=state_dtype,
                                        seconds=round(time.perf_counter() - start, 1),
                                        **result))
                print(json.dumps(out["runs"][-1]), file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
