"""The MegaFace challenge-1 protocol on embeddings: probes of known identities (FaceScrub)
against a growing set of distractors, in one pass over the distractor blocks.

- **Identification** (the devkit's): every ordered pair (p, m) of two different probe images of
  one identity is a search: m joins the distractors in the gallery and p searches it. The
  search succeeds at rank r when fewer than r distractors score at least s(p, m) (a tie ranks
  the distractor first). Rank-1 at a distractor count c uses the first c distractors (counts
  nest: 10 ⊂ 100 ⊂ …); the CMC (ranks 1 … R) uses all of them.
- **Verification**: genuine pairs are the unordered pairs of probe images of one identity,
  impostor pairs every (probe, distractor) pair, M = probes × distractors of them. At a target
  FAR f the threshold is the (⌊f·M⌋+1)-th largest impostor score, TAR the share of genuine pairs
  above it (a score equal to it is not accepted).
"""
import math

import numpy as np

from .scan import (DEFAULT_BLOCK_BYTES, LocalComm, TopK, collect_above, count_at_rate,
                   prepare_embeddings, scan)

__all__ = ["MEGAFACE_COUNTS", "distractor_counts", "megaface_report"]

MEGAFACE_COUNTS = (10, 100, 1000, 10_000, 100_000, 1_000_000)


def distractor_counts(n, counts=MEGAFACE_COUNTS):
    """The counts below `n`, and `n` itself (all distractors)."""
    return sorted({int(c) for c in counts if 0 < c < n} | {int(n)})


def _genuine(p, labels):
    """(ordered pairs' scores [G], their probe rows [G], unordered genuine scores): the
    different-image pairs of one identity."""
    s_all, rows_all, upper = [], [], []
    for lab in np.unique(labels):
        idx = np.flatnonzero(labels == lab)
        if len(idx) < 2:
            continue
        s = p[idx] @ p[idx].T
        i, j = np.nonzero(~np.eye(len(idx), dtype=bool))
        s_all.append(s[i, j])
        rows_all.append(idx[i])
        iu, ju = np.triu_indices(len(idx), 1)
        upper.append(s[iu, ju])
    if not s_all:
        raise ValueError("no probe identity has two images: no search can be made")
    return np.concatenate(s_all), np.concatenate(rows_all), np.concatenate(upper)


def megaface_report(probes, probe_labels, distractors, counts=MEGAFACE_COUNTS, fars=(1e-6,),
                    max_rank=10, roc_far_max=1e-3, normalize=True, block_bytes=DEFAULT_BLOCK_BYTES,
                    comm=None, seed=0):
    """{"counts": {c: rank-1}, "cmc": {r: share} (all distractors), "tar_at_far": {f: {"tar",
    "threshold", "false_accepts"}}, "roc": (far, tar) from FAR 1/M to `roc_far_max`, "searches",
    "genuine_pairs", "impostor_pairs"}. Distractor blocks are shared by the ranks of `comm`."""
    comm = comm or LocalComm()
    p, labels, d = _inputs(probes, probe_labels, distractors, normalize)
    n_p, n_d = len(p), len(d)
    counts = distractor_counts(n_d, counts)
    gen_s, gen_row, gen_pairs = _genuine(p, labels)
    impostors = n_p * n_d
    fars = [float(f) for f in fars]
    need = max([count_at_rate(f, impostors) for f in fars + [roc_far_max]]) + 1
    bound = _pilot_bound(p, d, need, impostors, seed, comm)
    seg_max, segments, top, kept = _scan(p, d, counts, bound, need, impostors, max_rank,
                                         block_bytes, comm)
    seg_max = comm.max(seg_max)
    local = kept if len(kept) <= need else np.partition(kept, len(kept) - need)[len(kept) - need:]
    imp = np.sort(comm.concat(local))[::-1]
    # the global top-R distractors of each probe: every rank's, merged
    all_top = comm.concat(top.scores.reshape(-1)).reshape(comm.world, n_p, max_rank)
    top_r = np.sort(np.concatenate(list(all_top), axis=1), axis=1)[:, ::-1][:, :max_rank]
    out = {"searches": int(len(gen_s)), "genuine_pairs": int(len(gen_pairs)),
           "impostor_pairs": int(impostors), "counts": {}, "cmc": {}, "tar_at_far": {}}
    _identification(out, counts, n_d, segments, seg_max, top_r, gen_s, gen_row, max_rank)
    _verification(out, fars, imp, impostors, gen_pairs, roc_far_max)
    return out


def _inputs(probes, probe_labels, distractors, normalize):
    """(probe embeddings, their labels, distractor embeddings), checked and prepared."""
    p = prepare_embeddings(probes, "probe embeddings", normalize)
    d = prepare_embeddings(distractors, "distractor embeddings", normalize)
    labels = np.asarray(probe_labels).reshape(-1)
    if len(labels) != len(p):
        raise ValueError(f"{len(labels)} probe labels for {len(p)} probe embeddings")
    if p.shape[1] != d.shape[1]:
        raise ValueError(f"probe embeddings are {p.shape[1]}-d, distractor embeddings {d.shape[1]}-d")
    if len(d) == 0:
        raise ValueError("no distractors")
    return p, labels, d


def _pilot_bound(p, d, need, impostors, seed, comm):
    """The pilot: a bound that some 4·need impostor scores pass, from a sample of distractors
    (the largest over the ranks)."""
    n_p, n_d = len(p), len(d)
    rng = np.random.default_rng(seed)
    sample = d[np.sort(rng.choice(n_d, min(n_d, max(64, (4 << 20) // n_p)), replace=False))]
    ps = (p @ sample.T).reshape(-1)
    want = int(math.ceil(4.0 * need / impostors * len(ps))) + 64
    bound = -np.inf if want >= len(ps) else float(np.partition(ps, len(ps) - want)[len(ps) - want])
    return float(comm.max(np.array([bound]))[0])


def _scan(p, d, counts, bound, need, impostors, max_rank, block_bytes, comm):
    """One pass over this rank's share of the (probe rows, distractor segment) blocks, again
    without a bound when too few impostor scores pass it: (each segment's maximum of each
    probe [segments, P] (this rank's, for the segments below the last count), the segments
    (c0, c1), this rank's `TopK` of each probe, the impostor scores above the bound)."""
    n_p, n_d = len(p), len(d)
    cols = max(1, min(8192, block_bytes // 4 // max(n_p, 1)))
    edges = sorted(set(counts) | set(range(0, n_d, cols)) | {0})
    segments = list(zip(edges[:-1], edges[1:]))
    rows = max(1, min(n_p, block_bytes // 4 // cols))
    work = [(r0, min(n_p, r0 + rows), j) for j in range(len(segments)) for r0 in range(0, n_p, rows)]
    segment_of = {c0: j for j, (c0, _) in enumerate(segments)}
    seg_max = np.full((len(segments), n_p), -np.inf, np.float32)
    below = counts[-2] if len(counts) > 1 else 0  # segments past it: all distractors, top-1 of TopK
    top = TopK(n_p, max_rank)
    while True:
        kept = []

        def consume(block, s):
            r0, r1, c0, c1 = block
            j = segment_of[c0]
            if c1 <= below:
                seg_max[j, r0:r1] = s.max(axis=1)
            kth = top.kth(r0, r1)
            if np.isneginf(kth).any():  # a first block: TopK bounds it itself
                top.update(r0, c0, s)
                kept.append(collect_above(s, bound)[2])
                return
            # one compare for both: above the row's k-th best (TopK) or above the bound (ROC)
            bar = np.nextafter(np.minimum(kth, np.float32(bound)), np.float32(np.inf))
            flat = np.flatnonzero((s >= bar[:, None]).reshape(-1))
            vals = s.reshape(-1)[flat]
            ri, ci = np.divmod(flat, c1 - c0)
            better = vals > kth[ri]
            top.merge(r0, c0, ri[better], ci[better], vals[better])
            kept.append(vals[vals > bound])

        scan(p, d, [(r0, r1, segments[j][0], segments[j][1]) for r0, r1, j in work[comm.rank::comm.world]],
             consume, rows * cols)
        kept = np.concatenate(kept) if kept else np.zeros(0, np.float32)
        if int(comm.sum(np.array([len(kept)]))[0]) >= min(need, impostors) or bound == -np.inf:
            break
        bound = -np.inf  # the pilot's bound was too high: scan again keeping every score
        top = TopK(n_p, max_rank)
    return seg_max, segments, top, kept


def _identification(out, counts, n_d, segments, seg_max, top_r, gen_s, gen_row, max_rank):
    """Fill `out`'s rank-1 at each distractor count and CMC."""
    ends = np.array([c1 for _, c1 in segments])
    prefix = np.maximum.accumulate(seg_max, axis=0)
    for c in counts:
        best = top_r[:, 0] if c == n_d else prefix[int(np.flatnonzero(ends == c)[0])]
        out["counts"][c] = float(np.mean(gen_s > best[gen_row]))
    ahead = (top_r[gen_row] >= gen_s[:, None]).sum(axis=1)
    for r in range(1, max_rank + 1):
        out["cmc"][r] = float(np.mean(ahead < r))


def _verification(out, fars, imp, impostors, gen_pairs, roc_far_max):
    """Fill `out`'s TAR at each FAR and ROC from the largest impostor scores `imp`
    (descending)."""

    def at(f):
        m = count_at_rate(f, impostors)
        t = -np.inf if m >= impostors else float(imp[m])
        fa = impostors if t == -np.inf else int(np.count_nonzero(imp > t))
        return t, fa

    for f in fars:
        t, fa = at(f)
        out["tar_at_far"][f] = {"tar": float(np.mean(gen_pairs > t)), "threshold": t, "false_accepts": fa}
    grid = np.unique(np.r_[1.0 / impostors, np.logspace(math.log10(max(1.0 / impostors, 1e-12)),
                                                        math.log10(roc_far_max), 60)])
    roc = [at(f) for f in grid]
    out["roc"] = (np.array([fa / impostors for _, fa in roc]),
                  np.array([float(np.mean(gen_pairs > t)) for t, _ in roc]))
