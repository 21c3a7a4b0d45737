"""IJB-B/C 1:N identification: the paper's open-set CMC / TPIR at FPIR and the ijb_1n.py-convention
figures against brute-force oracles (exact ties: features whose scores are exact in float32),
and tools/eval_ijb.py --protocol 1n on a synthetic layout with saved features."""
import csv
import json
import math
import os
from fractions import Fraction

import numpy as np
import pytest

import scripts
from ijb_layout import make_layout
from plsc.data.synthetic import write_ijb_1n_lists
from plsc.metrics import template_features
from plsc.metrics.identification import ijb_1n_convention, open_set_identification

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(os.path.dirname(HERE), "tools", "eval_ijb.py")
CONFIG = os.path.join(os.path.dirname(HERE), "configs", "demo.yaml")


def paper_oracle(P, ps, G, gs, ranks, fpirs):
    """Loops over probes: rank = 1 + non-mates scoring at least the best mate; the threshold at
    FPIR f = the (floor(f*n)+1)-th largest non-mated top score; accepted = strictly above."""
    S = np.asarray(P, np.float64) @ np.asarray(G, np.float64).T
    mated_rank, mated_best, nonmated_top = [], [], []
    for i in range(len(P)):
        mates = [S[i, j] for j in range(len(G)) if gs[j] == ps[i]]
        if mates:
            best = max(mates)
            mated_best.append(best)
            mated_rank.append(1 + sum(1 for j in range(len(G)) if gs[j] != ps[i] and S[i, j] >= best))
        else:
            nonmated_top.append(max(S[i]))
    out = {"cmc": {r: sum(1 for k in mated_rank if k <= r) / len(mated_rank) for r in ranks}, "tpir": {}}
    top = sorted(nonmated_top, reverse=True)
    for f in fpirs:
        m = int(Fraction(repr(f)) * len(top))
        t = top[m] if m < len(top) else -math.inf
        hits = sum(1 for k, b in zip(mated_rank, mated_best) if k == 1 and b > t)
        out["tpir"][f] = (hits / len(mated_rank), t, sum(1 for v in top if v > t) / len(top))
    return out, len(mated_rank), len(nonmated_top)


def convention_oracle(P, ps, G, gs, ranks, fars, literal_argsort=False):
    """A transcription of ijb_1n.py's evaluation: one gallery entry per probe subject (the
    mask); top-R from the rank of the mate (with literal_argsort: from np.argsort(-similarity),
    as the script, for tie-free scores); the threshold at "FAR" f: the ceil(n*f)-th largest
    of all non-mate scores; TPIR: mate score above it."""
    sim = np.asarray(P, np.float64) @ np.asarray(G, np.float64).T
    mask = [list(gs).index(s) for s in ps]
    if literal_argsort:
        order = np.argsort(-sim)
        top = {r: sum(1 for i in range(len(P)) if mask[i] in order[i, :r]) / len(P) for r in ranks}
    else:
        rank = [1 + sum(1 for j in range(len(G)) if j != mask[i] and sim[i, j] >= sim[i, mask[i]])
                for i in range(len(P))]
        top = {r: sum(1 for k in rank if k <= r) / len(P) for r in ranks}
    pos = np.array([sim[i, mask[i]] for i in range(len(P))])
    neg = sorted((sim[i, j] for i in range(len(P)) for j in range(len(G)) if j != mask[i]), reverse=True)
    tpir = {}
    for f in fars:
        th = neg[math.ceil(len(P) * f) - 1]
        tpir[f] = (float(np.sum(pos > th) / len(P)), th)
    return top, tpir


def tie_set(seed, n_probe=300, n_subjects=40, d=6):
    """Features with entries in {-2..2}/4: every dot product is a multiple of 1/16, exact."""
    rng = np.random.default_rng(seed)
    centre = rng.integers(-2, 3, (n_subjects, d))
    gs = np.r_[np.arange(n_subjects), rng.integers(0, n_subjects, 8)]   # some subjects twice
    G = (np.clip(centre[gs] + rng.integers(-1, 2, (len(gs), d)), -2, 2)) / 4.0
    ps = rng.integers(0, n_subjects + 25, n_probe)                         # subjects >= 40: no mate
    P = (np.clip(np.r_[centre, rng.integers(-2, 3, (25, d))][ps] + rng.integers(-1, 2, (n_probe, d)),
                 -2, 2)) / 4.0
    return P, ps, G, gs


@pytest.mark.parametrize("seed,block_bytes", [(0, 1 << 20), (1, 4096), (2, 1 << 12)])
def test_open_set_matches_brute_force_with_ties(seed, block_bytes):
    P, ps, G, gs = tie_set(seed)
    ranks, fpirs = (1, 2, 5, 10, 20), (0.001, 0.01, 0.05, 0.1, 0.3, 1.0)
    got = open_set_identification(P, ps, G, gs, ranks, fpirs, block_bytes=block_bytes)
    expect, n_m, n_n = paper_oracle(P, ps, G, gs, ranks, fpirs)
    assert (got["mated"], got["nonmated"]) == (n_m, n_n) and n_n > 20
    assert got["cmc"] == expect["cmc"]
    for f in fpirs:
        tpir, t, fpir = expect["tpir"][f]
        assert got["tpir_at_fpir"][f] == {"tpir": tpir, "threshold": t, "fpir": fpir}, f
        assert fpir <= f
    # ties happen: some non-mate equals a best mate score, some non-mated top equals a threshold
    S = P @ G.T
    assert any((S[i][gs != ps[i]] == S[i][gs == ps[i]].max()).any() for i in range(len(P)) if (gs == ps[i]).any())


def test_convention_matches_its_transcription():
    P, ps, G, gs = tie_set(3)
    keep = np.isin(ps, np.arange(40))
    Gm, gsm = G[:40], gs[:40]                                # one entry per subject
    top, tpir = convention_oracle(P[keep], ps[keep], Gm, gsm, (1, 5, 10), (0.01, 0.1))
    got = ijb_1n_convention(P[keep], ps[keep], Gm, gsm, (1, 5, 10), (0.01, 0.1), block_bytes=2048)
    assert got["top"] == top
    assert {f: (v["tpir"], v["threshold"]) for f, v in got["tpir_at_far"].items()} == tpir
    rng = np.random.default_rng(4)                           # continuous scores: the script's argsort
    P2, G2 = rng.normal(size=(200, 16)), rng.normal(size=(30, 16))
    s2 = rng.integers(0, 30, 200)
    P2 = P2 + 2 * G2[s2]
    top, tpir = convention_oracle(P2.astype(np.float32), s2, G2.astype(np.float32), np.arange(30),
                                  (1, 5, 10), (0.01, 0.1), literal_argsort=True)
    got = ijb_1n_convention(P2, s2, G2, np.arange(30))
    assert got["top"] == top
    for f in (0.01, 0.1):
        assert got["tpir_at_far"][f]["tpir"] == tpir[f][0]
        assert got["tpir_at_far"][f]["threshold"] == pytest.approx(tpir[f][1], abs=1e-5)


def test_convention_needs_one_gallery_entry_per_probe_subject():
    P, ps, G, gs = tie_set(5)
    with pytest.raises(ValueError, match="gallery entries; this convention needs exactly one"):
        ijb_1n_convention(P, ps, G, gs)   # unmated probes and subjects listed twice
    with pytest.raises(ValueError, match="no probe has a mate"):
        open_set_identification(P[ps >= 40], ps[ps >= 40], G, gs)


def _read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))[1:]
    subject = {int(r[0]): int(r[1]) for r in rows}
    tids = sorted(subject)
    return np.array(tids), np.array([subject[t] for t in tids])


def _tool(argv):
    return scripts.load(TOOL).main(argv)


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    base = tmp_path_factory.mktemp("ijb1n")
    root = str(base / "IJBC")
    ref = make_layout(root, num_identities=10, templates_per_identity=4)
    write_ijb_1n_lists(root, "ijbc", ref)
    rng = np.random.default_rng(0)
    ident = ref["identities"]
    feats = (rng.normal(size=(10, 24))[ident] * 0.3 + rng.normal(size=(len(ident), 24))).astype(np.float32)
    np.save(base / "feats.npy", feats)
    return {"root": root, "ref": ref, "feats": str(base / "feats.npy"), "base": base}


def test_tool_1n_figures_match_the_oracles(layout, tmp_path, capsys):
    root, ref = layout["root"], layout["ref"]
    code = _tool(["-c", CONFIG, "--root", root, "--target", "IJBC", "--protocol", "1n", "--features",
                  layout["feats"], "-o", f"Global.output_dir={tmp_path}"])
    assert code == 0
    text = capsys.readouterr().out
    assert "open set (IJB-C paper)" in text and "ijb_1n.py convention" in text
    saved = json.load(open(tmp_path / "ijbc_1n_result.json"))
    ids, tf = template_features(np.load(layout["feats"]), ref["templates"], ref["medias"], ref["det_scores"])
    lists = {k: _read_csv(os.path.join(root, "meta", f"ijbc_1N_{k}.csv"))
             for k in ("gallery_G1", "gallery_G2", "probe_mixed")}

    def f(t):
        return tf[np.searchsorted(ids, t)]

    pt, psub = lists["probe_mixed"]
    means = {}
    for g in ("G1", "G2"):
        gt, gsub = lists[f"gallery_{g}"]
        expect, n_m, n_n = paper_oracle(f(pt), psub, f(gt), gsub, (1, 5, 10, 20), (0.001, 0.01, 0.1))
        r = saved["galleries"][g]
        assert (r["mated"], r["nonmated"], r["templates"]) == (n_m, n_n, len(gt))
        assert n_m > 0 and n_n > 0  # the other gallery's subjects are non-mated here
        assert [r["cmc"][k] for k in ("1", "5", "10", "20")] == pytest.approx(
            [expect["cmc"][k] for k in (1, 5, 10, 20)], abs=1e-12)
        for key, fp in (("0.001", 0.001), ("0.01", 0.01), ("0.1", 0.1)):
            assert r["tpir_at_fpir"][key]["tpir"] == pytest.approx(expect["tpir"][fp][0], abs=1e-12)
            means.setdefault(key, []).append(expect["tpir"][fp][0])
    assert saved["mean"]["tpir_at_fpir"]["0.1"] == pytest.approx(np.mean(means["0.1"]))
    gt = np.r_[lists["gallery_G1"][0], lists["gallery_G2"][0]]
    gsub = np.r_[lists["gallery_G1"][1], lists["gallery_G2"][1]]
    top, tpir = convention_oracle(f(pt), psub, f(gt), gsub, (1, 5, 10), (0.01, 0.1))
    c = saved["ijb_1n_convention"]
    assert [c["top"][k] for k in ("1", "5", "10")] == pytest.approx([top[1], top[5], top[10]], abs=1e-12)
    assert c["tpir_at_far"]["0.1"]["tpir"] == pytest.approx(tpir[0.1][0], abs=1e-12)


def test_tool_1n_bad_lists_fail_in_one_line(layout, tmp_path, capsys):
    import shutil
    root = str(tmp_path / "IJBC")
    shutil.copytree(layout["root"], root, ignore=shutil.ignore_patterns("loose_crop"))
    args = ["-c", CONFIG, "--root", root, "--target", "IJBC", "--protocol", "1n", "--features",
            layout["feats"], "-o", f"Global.output_dir={tmp_path / 'out'}"]
    bad = np.load(layout["feats"])
    bad[4, 2] = np.nan
    np.save(tmp_path / "bad.npy", bad)
    assert _tool(args[:-3] + [str(tmp_path / "bad.npy")] + args[-2:]) == 65
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path / 'bad.npy'}: row 4 ({layout['ref']['names'][4]}) is not finite "
                   "(1 rows are not)"]
    g1 = os.path.join(root, "meta", "ijbc_1N_gallery_G1.csv")
    with open(g1, "a") as f:
        f.write("999999,5,x.jpg\n")
    lines = open(g1).read().count("\n")
    assert _tool(args) == 65
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {g1} line {lines}: template 999999 is not in ijbc_face_tid_mid.txt"]
    os.remove(g1)
    assert _tool(args) == 2
    assert "ijbc_1N_gallery_G1.csv does not exist" in capsys.readouterr().err
    # a probe whose subject has no gallery template: the merged-gallery convention cannot run
    shutil.copy(os.path.join(layout["root"], "meta", "ijbc_1N_gallery_G1.csv"), g1)
    probe = os.path.join(root, "meta", "ijbc_1N_probe_mixed.csv")
    text = open(probe).read().splitlines()
    first = text[1].split(",")
    text[1] = ",".join([first[0], "777"] + first[2:])
    text = [line for line in text if not line.startswith(first[0] + ",") or line == text[1]]
    open(probe, "w").write("\n".join(text) + "\n")
    assert _tool(args) == 65
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "probe subject 777 has 0 gallery entries" in err[0]


def test_from_images_equals_from_the_saved_features(layout, tmp_path):
    """The backbone path: features extracted (and saved) in the run give the figures that the
    saved features give again."""
    import paddle
    from trainer_common import config
    from plsc.apps.ijb_1n import evaluate_ijb_1n
    from plsc.parts import build_backbone
    cfg = config(str(tmp_path / "unused"), str(tmp_path / "out"), Eval={"batch_size": 16},
                 Logging={"visualdl": False, "progress_bar": False})
    paddle.seed(0)
    weights = str(tmp_path / "backbone.pdparams")
    paddle.save(build_backbone(cfg).state_dict(), weights)
    cfg["Global"]["pretrained"] = weights
    saved = str(tmp_path / "feats.npy")
    first = evaluate_ijb_1n(cfg, layout["root"], "IJBC", save_features=saved, progress=False,
                            out=open(os.devnull, "w"))
    assert np.load(saved).shape == (len(layout["ref"]["names"]), 32)
    again = evaluate_ijb_1n(cfg, layout["root"], "IJBC", features=saved, out=open(os.devnull, "w"))
    assert again == first
    assert first["galleries"]["G1"]["mated"] > 0 and first["ijb_1n_convention"]["probes"] == first["probes"]
