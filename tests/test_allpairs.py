"""All-pairs TAR@FAR (plsc.metrics.allpairs) and the block scan's top-k against brute force, on
embeddings whose scores are exact in float32 (many exact ties), one process and three
threads standing in for ranks; and tools/eval_allpairs.py end to end."""
import json
import os
import subprocess
import sys
import threading
from fractions import Fraction

import numpy as np
import pytest

from plsc.metrics.allpairs import allpairs_tar_at_far, pair_counts
from plsc.metrics.scan import TopK, blocks, threshold_at_rate

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(os.path.dirname(HERE), "tools", "eval_allpairs.py")


def exact_set(n, ids, d=16, seed=0):
    """Embeddings with entries k/8 (|k| <= 7): every dot product is exact in float32."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, ids, n)
    centre = rng.integers(-4, 5, (ids, d))
    return (centre[labels] + rng.integers(-3, 4, (n, d))) / 8.0, labels


def brute(x, labels, fars):
    """Every unordered pair i < j once; impostor scores sorted; threshold = the
    (floor(f*M)+1)-th largest impostor score; accepted = strictly above it."""
    s = np.asarray(x, np.float64) @ np.asarray(x, np.float64).T
    i, j = np.triu_indices(len(x), 1)
    v, same = s[i, j], labels[i] == labels[j]
    imp, gen = np.sort(v[~same])[::-1], v[same]
    out = {}
    for f in fars:
        m = int(Fraction(repr(f)) * len(imp))  # floor of a non-negative rational
        t = -np.inf if m >= len(imp) else imp[m]
        out[f] = {"tar": (gen > t).sum() / len(gen), "threshold": t, "false_accepts": int((imp > t).sum())}
    return out, len(imp), len(gen)


class ThreadComm:
    """`world` threads acting as ranks: each collective waits for all of them."""

    def __init__(self, rank, shared):
        self.rank, self.world, self.shared = rank, shared["world"], shared

    def _all(self, a, combine):
        box, barrier = self.shared["box"], self.shared["barrier"]
        box[self.rank] = np.asarray(a)
        barrier.wait()
        out = combine([box[r] for r in range(self.world)])
        barrier.wait()
        return out

    def sum(self, a):
        return self._all(a, lambda xs: np.sum(xs, axis=0))

    def max(self, a):
        return self._all(a, lambda xs: np.max(xs, axis=0))

    def concat(self, a):
        return self._all(a, np.concatenate)


def run_ranks(world, fn):
    shared = {"world": world, "box": {}, "barrier": threading.Barrier(world)}
    results, errors = [None] * world, []

    def body(r):
        try:
            results[r] = fn(ThreadComm(r, shared))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            shared["barrier"].abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("n,ids,block_bytes,low", [(3000, 300, 1 << 22, True), (700, 40, 1 << 16, False),
                                                   (401, 400, 1 << 20, True)])
def test_allpairs_matches_brute_force_with_ties(n, ids, block_bytes, low):
    x, labels = exact_set(n, ids)
    genuine, impostors = pair_counts(labels)
    fars = [0.5 / impostors, 1 / impostors, 2 / impostors, 1e-6, 1e-5, 1e-4, 1e-3]
    if not low:
        fars += [0.1, 0.5, 1.0]
    expect, m, g = brute(x, labels, fars)
    assert (g, m) == (genuine, impostors)
    stats = {}
    got = allpairs_tar_at_far(x, labels, fars, normalize=False, block_bytes=block_bytes, stats=stats)
    for f in fars:
        e = expect[f]
        assert got[f]["threshold"] == e["threshold"], f
        assert got[f]["false_accepts"] == e["false_accepts"], f
        assert got[f]["tar"] == e["tar"], f
        assert got[f]["false_accepts"] <= int(Fraction(repr(f)) * impostors)
    assert got[0.5 / impostors]["false_accepts"] == 0  # below 1/M: answered at FAR 0
    assert got[1 / impostors]["false_accepts"] <= 1
    if low:  # the pilot's bound kept only a small share of the pairs
        assert stats["bound"] > -np.inf and stats["kept"] < impostors / 10


def test_allpairs_three_thread_ranks_give_the_one_process_result():
    x, labels = exact_set(900, 60, seed=1)
    fars = [1e-5, 1e-4, 1e-3, 0.02]
    one = allpairs_tar_at_far(x, labels, fars, normalize=False, block_bytes=1 << 16)
    many = run_ranks(3, lambda comm: allpairs_tar_at_far(x, labels, fars, normalize=False,
                                                         block_bytes=1 << 16, comm=comm))
    assert all(r == one for r in many)
    expect = brute(x, labels, fars)[0]
    assert [one[f]["tar"] for f in fars] == [expect[f]["tar"] for f in fars]


def test_allpairs_normalises_float_embeddings():
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 50, 600)
    x = rng.normal(size=(50, 32))[labels] + 0.9 * rng.normal(size=(600, 32))
    fars = [1e-4, 1e-3, 1e-2]
    got = allpairs_tar_at_far(x * rng.uniform(0.5, 3, (600, 1)), labels, fars, block_bytes=1 << 16)
    u = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    expect = brute(u, labels, fars)[0]
    for f in fars:
        assert got[f]["threshold"] == pytest.approx(expect[f]["threshold"], abs=1e-6)
        assert got[f]["tar"] == expect[f]["tar"]


def test_bad_inputs_raise_one_line():
    x, labels = exact_set(50, 5)
    with pytest.raises(ValueError, match="49 labels for 50 embeddings"):
        allpairs_tar_at_far(x, labels[:49])
    bad = x.copy()
    bad[7, 3] = np.nan
    with pytest.raises(ValueError, match="row 7 is not finite"):
        allpairs_tar_at_far(bad, labels)
    with pytest.raises(ValueError, match="0 genuine"):
        allpairs_tar_at_far(x, np.arange(50))


def test_threshold_at_rate_counts_exactly():
    v = np.arange(100, dtype=np.float64)
    assert threshold_at_rate(v, 100, 0.29) == 70.0  # floor(0.29 * 100) = 29 above, not 28
    assert threshold_at_rate(v, 100, 0.0) == 99.0 and threshold_at_rate(v, 100, 1.0) == -np.inf


@pytest.mark.parametrize("k,cols,width,spread", [(1, 7, 301, 6), (5, 16, 301, 6), (20, 64, 301, 6),
                                                 (10, 1024, 3001, 6), (10, 700, 3001, 1000),
                                                 (10, 4096, 3001, 1000), (128, 2048, 5000, 50)])
def test_topk_of_blocks_matches_a_stable_sort(k, cols, width, spread):
    """Narrow blocks (compare only) and wide ones (the column-group bound), many ties or few."""
    rng = np.random.default_rng(k + cols)
    s = rng.integers(-spread, spread + 1, (37, width)).astype(np.float32)
    top = TopK(len(s), k)
    for r0, r1, c0, c1 in blocks(37, width, 11, cols):
        top.update(r0, c0, s[r0:r1, c0:c1])
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]  # equal scores: lower index first
    np.testing.assert_array_equal(top.index, order)
    np.testing.assert_array_equal(top.scores, np.take_along_axis(s, order, 1))


def test_tool_writes_the_result_and_rejects_bad_files(tmp_path):
    x, labels = exact_set(800, 80, seed=3)
    np.save(tmp_path / "emb.npy", x.astype(np.float32))
    np.save(tmp_path / "emb_labels.npy", labels)
    np.save(tmp_path / "short_labels.npy", labels[:-1])
    cfg = os.path.join(os.path.dirname(HERE), "configs", "demo.yaml")
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('tool', {TOOL!r})\n"
            "tool = importlib.util.module_from_spec(spec); spec.loader.exec_module(tool)\n"
            "print('CODES', [tool.main(a.split('|')) for a in sys.argv[1:]])")
    base = (f"-c|{cfg}|-o|Global.output_dir={tmp_path / 'out'}|--embeddings|{tmp_path / 'emb.npy'}"
            "|--no-normalize|--far|1e-5|--far|1e-3")
    runs = [base, base + f"|--labels|{tmp_path / 'short_labels.npy'}",
            f"-c|{cfg}|--embeddings|{tmp_path / 'nowhere.npy'}"]
    proc = subprocess.run([sys.executable, "-c", code] + runs, capture_output=True, text=True,
                          timeout=240, cwd=str(tmp_path))
    assert "CODES [0, 65, 2]" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "799 labels for 800 embeddings" in errors[0], proc.stderr
    assert "nowhere.npy" in errors[1]
    saved = json.load(open(tmp_path / "out" / "allpairs_result.json"))
    expect = brute(x, labels, [1e-5, 1e-3])[0]
    assert [r["tar"] for r in saved["tar_at_far"].values()] == [expect[1e-5]["tar"], expect[1e-3]["tar"]]
    assert "TAR (%)" in proc.stdout


def test_two_launched_ranks_share_the_blocks(tmp_path, run_ranks):
    """RankComm over Paddle's collectives: two ranks give the brute-force figures."""
    x, labels = exact_set(1200, 100, seed=4)
    np.save(tmp_path / "emb.npy", x.astype(np.float32))
    np.save(tmp_path / "emb_labels.npy", labels)
    cfg = os.path.join(os.path.dirname(HERE), "configs", "demo.yaml")
    done = run_ranks(TOOL, 2, ["-c", cfg, "-o", f"Global.output_dir={tmp_path / 'out'}",
                               "--embeddings", str(tmp_path / "emb.npy"), "--no-normalize",
                               "--block-mb", "1", "--far", "1e-6", "--far", "1e-4", "--far", "1e-2"],
                     cwd=str(tmp_path), timeout=240)
    assert done.status == 0, done.tail()
    saved = json.load(open(tmp_path / "out" / "allpairs_result.json"))
    expect = brute(x, labels, [1e-6, 1e-4, 1e-2])[0]
    assert saved["world_size"] == 2
    for key, f in (("1e-06", 1e-6), ("0.0001", 1e-4), ("0.01", 1e-2)):
        assert saved["tar_at_far"][key]["tar"] == expect[f]["tar"]
        assert saved["tar_at_far"][key]["false_accepts"] == expect[f]["false_accepts"]
