"""The MegaFace protocol (plsc.metrics.megaface) against brute force with exact ties, three
thread-ranks against one process, and tools/eval_megaface.py on a synthetic FaceScrub/MegaFace-like
folder pair (images through a backbone, noise lists) and on embeddings."""
import json
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from plsc.metrics.megaface import megaface_report
from test_allpairs import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(os.path.dirname(HERE), "tools", "eval_megaface.py")
BENCH = os.path.join(os.path.dirname(HERE), "benchmarks", "benchmark_identification.py")
CONFIG = os.path.join(os.path.dirname(HERE), "configs", "demo.yaml")


def tie_data(seed, ids=12, per=(1, 5), n_d=3000, d=6):
    """Entries in {-2..2}/4: exact float32 scores, many ties."""
    rng = np.random.default_rng(seed)
    centre = rng.integers(-2, 3, (ids, d))
    labels = np.concatenate([[i] * int(rng.integers(*per)) for i in range(ids)])
    probes = np.clip(centre[labels] + rng.integers(-1, 2, (len(labels), d)), -2, 2) / 4.0
    return probes, labels, rng.integers(-2, 3, (n_d, d)) / 4.0


def brute(P, labels, D, counts, ranks, fars):
    """Loops over the ordered pairs (p, m) of one identity: success at count c when s(p, m)
    beats every one of the first c distractors; rank = 1 + distractors scoring >= s(p, m)."""
    sp, sd = P @ P.T, P @ D.T
    pairs = [(a, b) for a in range(len(P)) for b in range(len(P)) if a != b and labels[a] == labels[b]]
    rank1 = {c: sum(1 for a, b in pairs if sp[a, b] > sd[a, :c].max()) / len(pairs) for c in counts}
    rank = [1 + int((sd[a] >= sp[a, b]).sum()) for a, b in pairs]
    cmc = {r: sum(1 for k in rank if k <= r) / len(pairs) for r in ranks}
    genuine = [sp[a, b] for a, b in pairs if a < b]
    imp = np.sort(sd.reshape(-1))[::-1]
    tar = {}
    for f in fars:
        m = int(Fraction(repr(f)) * len(imp))
        t = imp[m] if m < len(imp) else -np.inf
        tar[f] = (sum(1 for g in genuine if g > t) / len(genuine), t)
    return rank1, cmc, tar


@pytest.mark.parametrize("seed,block_bytes", [(0, 1 << 20), (1, 1 << 12)])
def test_megaface_matches_brute_force_with_ties(seed, block_bytes):
    P, labels, D = tie_data(seed)
    counts, fars = (10, 100, 1000), (1e-6, 1e-4, 1e-3, 1e-2)
    got = megaface_report(P, labels, D, counts, fars, max_rank=10, roc_far_max=1e-2, normalize=False,
                          block_bytes=block_bytes)
    rank1, cmc, tar = brute(P, labels, D, (10, 100, 1000, 3000), range(1, 11), fars)
    assert got["counts"] == rank1
    assert got["cmc"] == cmc
    for f in fars:
        assert (got["tar_at_far"][f]["tar"], got["tar_at_far"][f]["threshold"]) == tar[f], f
    far, tpr = got["roc"]
    assert (np.diff(far) >= 0).all() and (np.diff(tpr) >= 0).all() and far[-1] <= 1e-2


def test_megaface_thread_ranks_give_the_one_process_result():
    P, labels, D = tie_data(2, n_d=2500)
    kw = dict(counts=(10, 100, 1000), fars=(1e-5, 1e-3), normalize=False, block_bytes=1 << 12)
    one = megaface_report(P, labels, D, **kw)
    many = run_ranks(3, lambda comm: megaface_report(P, labels, D, comm=comm, **kw))
    for r in many:
        assert r["counts"] == one["counts"] and r["cmc"] == one["cmc"]
        assert r["tar_at_far"] == one["tar_at_far"]


def test_megaface_bad_inputs():
    P, labels, D = tie_data(3)
    with pytest.raises(ValueError, match="probe labels"):
        megaface_report(P, labels[:-1], D)
    with pytest.raises(ValueError, match="no probe identity has two images"):
        megaface_report(P[:3], np.arange(3), D)
    bad = D.copy()
    bad[5, 1] = np.nan
    with pytest.raises(ValueError, match="distractor embeddings: row 5 is not finite"):
        megaface_report(P, labels, bad)


@pytest.fixture(scope="module")
def folder_pair(tmp_path_factory):
    """The synthetic FaceScrub/MegaFace-like pair and freshly initialised demo weights."""
    base = tmp_path_factory.mktemp("megaface")
    proc = subprocess.run([sys.executable, BENCH, "--make-megaface", str(base / "layout"), "--identities", "6",
                           "--distractors", "40"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"made": json.loads(proc.stdout), "base": base, "weights": base / "w.pdparams"}


def test_tool_on_a_synthetic_folder_pair_and_on_embeddings(folder_pair, tmp_path):
    """Images through the demo backbone (noise lists dropping a probe and two distractors), then
    the same figures from the saved embeddings; bad files: one line, 65 / 2."""
    made, weights = folder_pair["made"], folder_pair["weights"]
    out = folder_pair["base"] / "out"
    code = ("import importlib.util, sys, paddle\n"
            "from plsc.config import load_config\n"
            "from plsc.parts import build_backbone\n"
            f"paddle.seed(0); paddle.save(build_backbone(load_config({CONFIG!r})).state_dict(), {str(weights)!r})\n"
            f"spec = importlib.util.spec_from_file_location('tool', {TOOL!r})\n"
            "tool = importlib.util.module_from_spec(spec); spec.loader.exec_module(tool)\n"
            "print('CODES', [tool.main(a.split('|')) for a in sys.argv[1:]])")
    c = f"-c|{CONFIG}|-o|Global.pretrained={weights}|-o|Global.output_dir={out}"
    runs = [f"{c}|--probes|{made['probes']}|--distractors|{made['distractors']}|--probe-noise|"
            f"{made['probe_noise']}|--distractor-noise|{made['distractor_noise']}|--save-embeddings|"
            f"{tmp_path / 'emb'}",
            f"{c}-2|-o|Logging.visualdl=true|--probes|{tmp_path / 'emb_probes.npy'}|--distractors|"
            f"{tmp_path / 'emb_distractors.npy'}",
            f"{c}|--probes|{tmp_path / 'emb_probes.npy'}|--distractors|{made['bad_npy']}",
            f"{c}|--probes|{tmp_path / 'nowhere'}|--distractors|{made['distractors']}"]
    proc = subprocess.run([sys.executable, "-c", code] + runs, capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path))
    assert "CODES [0, 0, 65, 2]" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "row 2 is not finite" in errors[0] and "nowhere" in errors[1], errors
    first = json.load(open(out / "megaface_result.json"))
    second = json.load(open(str(out) + "-2/megaface_result.json"))
    assert first["num_probes"] == made["num_probes"] - 1 and first["num_distractors"] == 38
    assert first["dropped_as_noise"] == {"probes": 1, "distractors": 2}
    for key in ("counts", "cmc", "tar_at_far", "searches"):
        assert first[key] == second[key]
    P = np.load(tmp_path / "emb_probes.npy")
    D = np.load(tmp_path / "emb_distractors.npy")
    labels = np.load(tmp_path / "emb_probes_labels.npy")
    Pn = P / np.linalg.norm(P, axis=1, keepdims=True)
    Dn = D / np.linalg.norm(D, axis=1, keepdims=True)
    rank1, cmc, _ = brute(Pn.astype(np.float64), labels, Dn.astype(np.float64), (10, 38), (1, 5), ())
    assert first["counts"]["10"] == pytest.approx(rank1[10], abs=0.02)  # float32 vs float64 near-ties
    assert first["counts"]["38"] == pytest.approx(rank1[38], abs=0.02)
    for name in ("megaface_cmc.png", "megaface_rank1.png", "megaface_roc.png"):
        assert os.path.getsize(out / name) > 1000
    from visualdl import LogReader
    vdl = str(out) + "-2/vdl"
    tags = LogReader(file_path=os.path.join(vdl, os.listdir(vdl)[0])).get_tags()
    assert {"megaface/cmc", "megaface/rank1", "megaface/roc"} <= set(tags["image"])
    assert {"megaface/rank1_at_10", "megaface/tar_at_far_1e-06"} <= set(tags["scalar"])
    folder_pair["single"] = first


def test_two_launched_ranks_give_the_one_process_result(folder_pair, tmp_path, run_ranks):
    """Both ranks embed a share of the images and scan a share of the distractor blocks."""
    if "single" not in folder_pair:
        pytest.skip("needs the one-process run of the test above")
    made = folder_pair["made"]
    done = run_ranks(TOOL, 2, ["-c", CONFIG, "-o", f"Global.pretrained={folder_pair['weights']}",
                               "-o", f"Global.output_dir={tmp_path / 'out'}", "-o", "Eval.batch_size=8",
                               "--probes", made["probes"], "--distractors", made["distractors"],
                               "--probe-noise", made["probe_noise"],
                               "--distractor-noise", made["distractor_noise"]],
                     cwd=str(tmp_path), timeout=240)
    assert done.status == 0, done.tail()
    two = json.load(open(tmp_path / "out" / "megaface_result.json"))
    one = folder_pair["single"]
    assert two["world_size"] == 2 and two["num_probes"] == one["num_probes"]
    for key in ("counts", "cmc"):
        assert two[key] == pytest.approx(one[key], abs=1e-9)
    assert two["tar_at_far"]["1e-06"]["tar"] == pytest.approx(one["tar_at_far"]["1e-06"]["tar"], abs=1e-9)
