"""plsc.search against brute force: exact top-k (ties: lower row first), faiss IVF/HNSW recall
against exact, index files, the open-set threshold at a target FPIR, the overlap report; and
tools/search.py end to end in one process."""
import json
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from plsc.search import build_index, load_index, open_set_threshold, overlap_report, recall_at_k

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(os.path.dirname(HERE), "tools", "search.py")
CONFIG = os.path.join(os.path.dirname(HERE), "configs", "demo.yaml")


def clustered(n, ids, d, seed, spread=0.7):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, ids, n)
    return (rng.normal(size=(ids, d))[labels] + spread * rng.normal(size=(n, d))).astype(np.float32), labels


def test_exact_search_matches_a_stable_sort_with_ties():
    rng = np.random.default_rng(0)
    g = rng.integers(-2, 3, (5000, 8)) / 4.0          # exact scores, many ties
    q = rng.integers(-2, 3, (70, 8)) / 4.0
    index = build_index(g, np.arange(5000) + 7, normalize=False)
    scores, rows = index.search(q, 15, block_bytes=1 << 16)
    s = q @ g.T
    order = np.argsort(-s, axis=1, kind="stable")[:, :15]
    np.testing.assert_array_equal(rows, order)
    np.testing.assert_array_equal(scores, np.take_along_axis(s, order, 1))
    small = build_index(g[:3], normalize=False).search(q, 5)  # fewer rows than k
    assert (small[1][:, 3:] == -1).all() and np.isneginf(small[0][:, 3:]).all()


@pytest.mark.parametrize("kind,floor", [("ivf", 0.9), ("hnsw", 0.95)])
def test_faiss_recall_against_exact(kind, floor, tmp_path):
    if os.environ.get("CI") != "true":  # CI installs the test extra, faiss-cpu with it: no skip there
        pytest.importorskip("faiss")
    g, _ = clustered(8000, 800, 64, 1)
    q = g[:400] + 0.5 * np.random.default_rng(2).normal(size=(400, 64)).astype(np.float32)
    exact = build_index(g).search(q, 10)[1]
    index = build_index(g, kind=kind, nprobe=16)
    found = index.search(q, 10)[1]
    recall = recall_at_k(found, exact)
    print(f"{kind} recall@10 against exact: {recall:.4f}")
    assert floor <= recall <= 1.0, recall
    assert recall_at_k(exact, exact) == 1.0 and recall_at_k(exact[:, ::-1] * 0 - 1, exact) == 0.0
    path = str(tmp_path / f"{kind}.index")
    index.save(path)
    again = load_index(path)
    assert again.kind == kind
    np.testing.assert_array_equal(again.search(q, 10)[1], found)


def test_exact_index_file_round_trip_and_bad_files(tmp_path):
    g, labels = clustered(300, 30, 16, 3)
    index = build_index(g, labels.astype(str))
    path = str(tmp_path / "g.index")
    index.save(path)
    again = load_index(path)
    q = g[:20]
    np.testing.assert_array_equal(again.search(q, 4)[1], index.search(q, 4)[1])
    assert again.ids.tolist() == labels.astype(str).tolist()
    (tmp_path / "bad.index").write_bytes(b"not an index")
    with pytest.raises(ValueError, match="not a plsc search index"):
        load_index(str(tmp_path / "bad.index"))
    with pytest.raises(ValueError, match="index kind 'lsh'"):
        build_index(g, kind="lsh")


def test_open_set_threshold_matches_brute_force():
    rng = np.random.default_rng(4)
    g = rng.integers(-2, 3, (400, 6)) / 4.0
    nonmated = rng.integers(-2, 3, (250, 6)) / 4.0
    index = build_index(g, normalize=False)
    top_brute = sorted((nonmated @ g.T).max(axis=1), reverse=True)
    for fpir in (0.0, 0.004, 0.01, 0.1, 0.5):
        t, top = open_set_threshold(index, nonmated, fpir)
        m = int(Fraction(repr(fpir)) * 250)
        assert t == top_brute[m]
        assert int((top > t).sum()) == sum(1 for v in top_brute if v > t) <= m


def test_overlap_report_matches_brute_force():
    train, tl = clustered(2000, 100, 32, 5)
    test = np.r_[train[:30] + 0.05, clustered(200, 50, 32, 6)[0]]
    sl = np.r_[tl[:30], np.full(200, 999)]
    report = overlap_report(["ann", "bob", "cy"], ["cy", "dee", "ann"], train, test, 0.95, tl, sl,
                            block_bytes=1 << 14)
    assert report["names"] == ["ann", "cy"] and report["shared_names"] == 2
    a = test / np.linalg.norm(test, axis=1, keepdims=True)
    b = train / np.linalg.norm(train, axis=1, keepdims=True)
    s = a.astype(np.float64) @ b.T.astype(np.float64)
    i, j = np.nonzero(s > 0.95)
    assert report["near_duplicates"] == len(i) >= 30
    assert {(p["test"], p["train"]) for p in report["pairs"]} == set(zip(i.tolist(), j.tolist()))
    scores = [p["score"] for p in report["pairs"]]
    assert scores == sorted(scores, reverse=True)
    assert report["train_labels_hit"] == sorted(set(tl[j].tolist()))


def test_tool_build_threshold_query_overlap_and_errors(tmp_path):
    g, labels = clustered(3000, 200, 32, 7)
    rng = np.random.default_rng(8)
    np.save(tmp_path / "g.npy", g)
    np.save(tmp_path / "g_labels.npy", labels)
    q = g[:40] + 0.2 * rng.normal(size=(40, 32)).astype(np.float32)
    np.save(tmp_path / "q.npy", q)
    np.save(tmp_path / "n.npy", rng.normal(size=(100, 32)).astype(np.float32))
    bad = q.copy()
    bad[3, 0] = np.inf
    np.save(tmp_path / "bad.npy", bad)
    (tmp_path / "train.txt").write_text("ann\nbob\n\ncy\n")
    os.makedirs(tmp_path / "test" / "cy")
    os.makedirs(tmp_path / "test" / "eve")
    c = f"-c|{CONFIG}"
    runs = [f"{c}|build|--embeddings|g.npy|--index|g.index",
            f"{c}|query|--index|g.index|--queries|q.npy|-k|5|--output|top.npz|--nonmated|n.npy|--fpir|0.05",
            f"{c}|overlap|--train-names|train.txt|--test-names|test|--output|ov.json",
            f"{c}|query|--index|g.index|--queries|bad.npy|--output|x.npz",
            f"{c}|query|--index|nowhere.index|--queries|q.npy|--output|x.npz"]
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('tool', {TOOL!r})\n"
            "tool = importlib.util.module_from_spec(spec); spec.loader.exec_module(tool)\n"
            "print('CODES', [tool.main(a.split('|')) for a in sys.argv[1:]])")
    proc = subprocess.run([sys.executable, "-c", code] + runs, capture_output=True, text=True,
                          timeout=240, cwd=str(tmp_path))
    assert "CODES [0, 0, 0, 65, 2]" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: bad.npy: row 3 is not finite (1 rows are not)",
                      "error: index file nowhere.index does not exist"]
    top = np.load(tmp_path / "top.npz")
    gn = g / np.linalg.norm(g, axis=1, keepdims=True)
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    order = np.argsort(-(qn @ gn.T), axis=1, kind="stable")[:, :5]
    assert (top["rows"] == order).mean() > 0.99  # float32 against float64 near-ties aside
    np.testing.assert_array_equal(top["ids"], labels[top["rows"]])
    n = np.load(tmp_path / "n.npy")
    tops = np.sort(((n / np.linalg.norm(n, axis=1, keepdims=True)) @ gn.T).max(1))[::-1]
    assert float(top["threshold"]) == pytest.approx(tops[5], abs=1e-6)  # floor(0.05 * 100) + 1 = 6th
    assert top["accepted"].tolist() == (top["scores"][:, 0] > top["threshold"]).tolist()
    report = json.load(open(tmp_path / "ov.json"))
    assert report["names"] == ["cy"]
