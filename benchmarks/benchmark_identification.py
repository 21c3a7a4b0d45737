"""Speed of the identification scans against a plain GEMM in the same process, and synthetic
layouts. Prints JSON.

    python benchmarks/benchmark_identification.py [--n 32768] [--dim 512] [--repeats 3]
    python benchmarks/benchmark_identification.py --megaface-distractors 1000000 [--probes 3530]
    python benchmarks/benchmark_identification.py --make-megaface DIR [--identities 6] [--distractors 40]

The first: the all-pairs scan (plsc.metrics.allpairs, N random clustered unit embeddings, FAR
1e-4 … 1e-7) and a 1:N exact search (plsc.search, top-10 of N/8 queries against N), each timed
`--repeats` times, alternating with runs of the plain float32 GEMMs of the same blocks (numpy
matmul into a reused buffer, nothing else); GFLOP/s count the GEMM flops of those blocks (2·d
per score; the all-pairs scan computes whole diagonal blocks, and its pilot sample is extra
time). `ratio`: the plain GEMMs' best time over the scan's best (the best of each, so that the
other work on a shared machine weighs on neither). The second: the MegaFace protocol
(plsc.metrics.megaface) from random 512-d unit embeddings (probes: 10 noisy images of each
identity), the wall time of one run, and its rate against the best of 6 plain passes over its
first 40 blocks (3 before, 3 after). The third writes a FaceScrub/MegaFace-like folder pair
(plsc.data.synthetic.generate_megaface) and a distractor .npy with a non-finite row for tests.
"""
import argparse
import json
import os
import sys
import time

import numpy as np


def _gemm_rate(a, b, buf, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b.T, out=buf)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * a.shape[0] * b.shape[0] * a.shape[1] / best / 1e9


def _clustered(n, dim, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, max(1, n // 10), n)
    x = rng.standard_normal((max(1, n // 10), dim), dtype=np.float32)[labels]
    x += 1.5 * rng.standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, labels


def _plain(a, b, work, buf):
    """Seconds of the plain GEMMs of the blocks `work` (r0, r1, c0, c1) of a @ b.T into `buf`."""
    t0 = time.perf_counter()
    for r0, r1, c0, c1 in work:
        np.matmul(a[r0:r1], b[c0:c1].T, out=buf[:(r1 - r0) * (c1 - c0)].reshape(r1 - r0, c1 - c0))
    return time.perf_counter() - t0


def speed(n, dim, repeats):
    from plsc.metrics.allpairs import allpairs_tar_at_far
    from plsc.metrics.scan import block_size, blocks
    from plsc.search import build_index
    x, labels = _clustered(n, dim, 0)
    q = x[: n // 8]
    rows, cols = block_size(n, n)
    buf = np.empty(rows * cols, np.float32)
    plans = {"allpairs": (x, x, blocks(n, n, rows, cols, upper=True)),
             "search": (q, x, blocks(len(q), n, *block_size(len(q), n)))}
    out = {"n": n, "dim": dim, "queries": len(q), "k": 10, "block": [rows, cols],
           "threads": os.environ.get("OMP_NUM_THREADS")}
    index = build_index(x, normalize=False)
    for name, (a, b, work) in plans.items():
        flops = 2.0 * dim * sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in work)
        plain, fused = [_plain(a, b, work, buf)], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if name == "allpairs":
                stats = {}
                allpairs_tar_at_far(x, labels, normalize=False, stats=stats)
                assert stats["flops"] == flops
            else:
                index.search(q, 10)
            fused.append(time.perf_counter() - t0)
            plain.append(_plain(a, b, work, buf))
        out[name] = {"seconds": round(min(fused), 3), "gflops": round(flops / min(fused) / 1e9, 1),
                     "gemm_gflops": round(flops / min(plain) / 1e9, 1),
                     "ratio": round(min(plain) / min(fused), 3),
                     "all_seconds": [round(v, 3) for v in fused], "all_gemm_seconds": [round(v, 3) for v in plain]}
    return out


def megaface(num_probes, num_distractors, dim, per_identity=10):
    from plsc.metrics.megaface import megaface_report
    rng = np.random.default_rng(1)
    labels = np.repeat(np.arange(num_probes // per_identity + 1), per_identity)[:num_probes]
    centres = rng.standard_normal((labels.max() + 1, dim), dtype=np.float32)
    p = centres[labels] + 2.0 * rng.standard_normal((num_probes, dim), dtype=np.float32)
    d = np.empty((num_distractors, dim), np.float32)
    for lo in range(0, num_distractors, 1 << 16):  # in chunks: no temporary of the whole set
        part = rng.standard_normal((min(1 << 16, num_distractors - lo), dim), dtype=np.float32)
        d[lo:lo + len(part)] = part / np.linalg.norm(part, axis=1, keepdims=True)
    p /= np.linalg.norm(p, axis=1, keepdims=True)
    cols = max(1, min(8192, (64 << 20) // 4 // num_probes))  # the scan's block (64 MB budget)
    work = [(0, num_probes, c0, min(c0 + cols, num_distractors)) for c0 in range(0, min(num_distractors, 40 * cols), cols)]
    buf = np.empty(num_probes * cols, np.float32)
    plain_flops = 2.0 * dim * sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in work)
    plain = [_plain(p, d, work, buf) for _ in range(3)]
    t0 = time.perf_counter()
    r = megaface_report(p, labels, d, normalize=False)
    seconds = time.perf_counter() - t0
    plain += [_plain(p, d, work, buf) for _ in range(3)]
    rate, gemm = 2.0 * num_probes * num_distractors * dim / seconds, plain_flops / min(plain)
    return {"probes": num_probes, "distractors": num_distractors, "dim": dim, "seconds": round(seconds, 1),
            "gflops": round(rate / 1e9, 1), "gemm_gflops": round(gemm / 1e9, 1), "ratio": round(rate / gemm, 3),
            "rank1": r["counts"], "tar_at_far": {str(k): v["tar"] for k, v in r["tar_at_far"].items()}}


def main(argv=None):
    parser = argparse.ArgumentParser(description="Benchmark the identification scans (JSON on stdout).")
    parser.add_argument("--n", type=int, default=32768, help="embeddings of the all-pairs scan / gallery")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--megaface-distractors", type=int, help="time the MegaFace protocol instead")
    parser.add_argument("--probes", type=int, default=3530, help="MegaFace probes (FaceScrub: 3,530)")
    parser.add_argument("--make-megaface", metavar="DIR", help="write a synthetic folder pair and exit")
    parser.add_argument("--identities", type=int, default=6)
    parser.add_argument("--distractors", type=int, default=40)
    args = parser.parse_args(argv)
    if args.make_megaface:
        from plsc.data.synthetic import generate_megaface
        made = generate_megaface(args.make_megaface, args.identities, num_distractors=args.distractors)
        bad = np.ones((5, 8), np.float32)
        bad[2, 1] = np.nan
        made["bad_npy"] = os.path.join(args.make_megaface, "bad_distractors.npy")
        np.save(made["bad_npy"], bad)
        print(json.dumps(made, indent=1))
        return 0
    if args.megaface_distractors:
        print(json.dumps(megaface(args.probes, args.megaface_distractors, args.dim), indent=1))
        return 0
    print(json.dumps(speed(args.n, args.dim, args.repeats), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
