"""1:N identification: CMC and TPIR at FPIR under the open-set definitions of the IJB-C paper
(Maze et al., 2018; NIST FRVT 1:N), and the figures under the convention of insightface's
`ijb_1n.py`.

A search is a probe against a gallery of entries (templates or images) with subject ids.
Mated search: the probe's subject has an entry in the gallery; non-mated otherwise. Scores:
float32 dot products (the callers pass L2-normalised features). Tie rule, as everywhere in
plsc: a score equal to a threshold is not accepted, and a non-mate scoring equal to the mate
ranks ahead of it: the mate's rank is 1 + the number of non-mate entries scoring at least
the best mate score.

- CMC(R): the share of mated searches whose mate is at rank ≤ R.
- FPIR(t): the share of non-mated searches whose top score is above t.
- TPIR(t) (at rank 1): the share of mated searches whose mate is at rank 1 and above t.
- At a target FPIR f over n non-mated searches, t is the lowest threshold with at most ⌊f·n⌋
  of them above it: the (⌊f·n⌋+1)-th largest non-mated top score.
"""
import math

import numpy as np

from .scan import ScoreBuffer, prepare_embeddings, threshold_at_rate, DEFAULT_BLOCK_BYTES

__all__ = ["CMC_RANKS", "FPIR_TARGETS", "IJB1N_RANKS", "IJB1N_FARS", "search_statistics",
           "open_set_identification", "ijb_1n_convention"]

CMC_RANKS = (1, 5, 10, 20)
FPIR_TARGETS = (0.001, 0.01, 0.1)
IJB1N_RANKS = (1, 5, 10)
IJB1N_FARS = (0.01, 0.1)


def _subject_codes(probe_subjects, gallery_subjects):
    """Integer codes shared by both subject arrays."""
    _, codes = np.unique(np.concatenate([np.asarray(gallery_subjects).reshape(-1),
                                         np.asarray(probe_subjects).reshape(-1)]), return_inverse=True)
    return codes[len(gallery_subjects):], codes[:len(gallery_subjects)]


def search_statistics(probe, probe_subjects, gallery, gallery_subjects, keep_nonmate_top=0,
                      block_bytes=DEFAULT_BLOCK_BYTES):
    """Per probe: `mated` (bool), `mate` (best mate score, -inf when unmated), `rank` (of the
    best mate; 0 when unmated), `top` (the best score over the gallery); and `nonmate_top`,
    the `keep_nonmate_top` largest of all non-mate scores (every probe, every non-mate
    entry). Probe blocks against the whole gallery at once (rows within `block_bytes`)."""
    p = prepare_embeddings(probe, "probe features", normalize=False)
    g = prepare_embeddings(gallery, "gallery features", normalize=False)
    if p.shape[1] != g.shape[1]:
        raise ValueError(f"probe features are {p.shape[1]}-d, gallery features {g.shape[1]}-d")
    if len(probe_subjects) != len(p) or len(gallery_subjects) != len(g):
        raise ValueError(f"{len(probe_subjects)} probe subjects for {len(p)} probes, "
                         f"{len(gallery_subjects)} gallery subjects for {len(g)} entries")
    ps, gs = _subject_codes(probe_subjects, gallery_subjects)
    n = len(p)
    mate, top = np.full(n, -np.inf, np.float32), np.full(n, -np.inf, np.float32)
    rank = np.zeros(n, np.int64)
    rows = max(1, block_bytes // 4 // max(len(g), 1))
    buf = ScoreBuffer(min(rows, n) * len(g))
    kept = np.zeros(0, np.float32)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        s = buf.scores(p[r0:r1], g)
        is_mate = ps[r0:r1, None] == gs[None, :]
        best = np.where(is_mate, s, -np.inf).max(axis=1) if len(g) else np.full(r1 - r0, -np.inf)
        mate[r0:r1] = best
        top[r0:r1] = s.max(axis=1) if len(g) else -np.inf
        ahead = ((s >= best[:, None]) & ~is_mate).sum(axis=1)
        rank[r0:r1] = np.where(np.isfinite(best), ahead + 1, 0)
        if keep_nonmate_top:
            v = s[~is_mate]
            v = np.concatenate([kept, v])
            kept = v if len(v) <= keep_nonmate_top else \
                np.partition(v, len(v) - keep_nonmate_top)[len(v) - keep_nonmate_top:]
    return {"mated": rank > 0, "mate": mate, "rank": rank, "top": top,
            "nonmate_top": np.sort(kept)[::-1]}


def open_set_identification(probe, probe_subjects, gallery, gallery_subjects, ranks=CMC_RANKS,
                            fpirs=FPIR_TARGETS, block_bytes=DEFAULT_BLOCK_BYTES):
    """The paper's figures of one gallery (see the module): {"mated", "nonmated", "cmc" {R: share},
    "tpir_at_fpir" {f: {"tpir", "threshold", "fpir"}} (None without non-mated searches)}.
    ValueError when no search is mated."""
    st = search_statistics(probe, probe_subjects, gallery, gallery_subjects, 0, block_bytes)
    mated = st["mated"]
    n_m, n_n = int(mated.sum()), int((~mated).sum())
    if n_m == 0:
        raise ValueError("no probe has a mate in the gallery: CMC and TPIR need mated searches")
    rank, mate, nonmated_top = st["rank"][mated], st["mate"][mated], st["top"][~mated]
    out = {"mated": n_m, "nonmated": n_n,
           "cmc": {int(r): float(np.mean(rank <= r)) for r in ranks}, "tpir_at_fpir": {}}
    for f in fpirs:
        if n_n == 0:
            out["tpir_at_fpir"][float(f)] = None
            continue
        t = threshold_at_rate(nonmated_top, n_n, f)
        out["tpir_at_fpir"][float(f)] = {
            "tpir": float(np.mean((rank == 1) & (mate > t))), "threshold": t,
            "fpir": float(np.mean(nonmated_top > t))}
    return out


def ijb_1n_convention(probe, probe_subjects, gallery, gallery_subjects, ranks=IJB1N_RANKS,
                      fars=IJB1N_FARS, block_bytes=DEFAULT_BLOCK_BYTES):
    """The figures of insightface's `ijb_1n.py` on one (merged) gallery in which every probe
    subject has exactly one entry: top-R accuracy {R: share}, and for each "FAR" f the share of
    probes whose mate score is above the ⌈n_probes·f⌉-th largest of all n_probes·(n_gallery−1)
    non-mate scores. Ties follow plsc's rule (the script orders tied scores by np.argsort).
    ValueError naming a probe subject with no entry, or with several."""
    ps, gs = _subject_codes(probe_subjects, gallery_subjects)
    count = np.bincount(gs, minlength=int(max(ps.max(initial=0), gs.max(initial=0))) + 1)
    bad = np.flatnonzero(count[ps] != 1)
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"probe subject {np.asarray(probe_subjects).reshape(-1)[i]} has "
                         f"{int(count[ps[i]])} gallery entries; this convention needs exactly one "
                         f"({len(bad)} probes)")
    n = len(ps)
    need = {float(f): math.ceil(n * f) for f in fars}  # the script's float product
    st = search_statistics(probe, probe_subjects, gallery, gallery_subjects,
                           max(need.values(), default=0), block_bytes)
    rank, mate, neg = st["rank"], st["mate"], st["nonmate_top"]
    out = {"probes": n, "gallery": int(len(gs)), "top": {int(r): float(np.mean(rank <= r)) for r in ranks},
           "tpir_at_far": {}}
    for f, k in need.items():
        th = float(neg[k - 1]) if 1 <= k <= len(neg) else (-np.inf if k > len(neg) else np.inf)
        out["tpir_at_far"][f] = {"tpir": float(np.mean(mate > th)), "threshold": th, "k": int(k)}
    return out
