"""Exact TAR at very low FAR over all pairs of a labelled embedding set, streamed in blocks.

Pairs: the N(N−1)/2 unordered pairs {i, j}, i ≠ j (no self-pairs, each pair once);
genuine when the two labels are equal, impostor otherwise. Score: the cosine (the dot
product of L2-normalised float32 embeddings, float32 GEMM). At a target FAR f over M
impostor pairs the threshold is the lowest t that accepts (score > t; a score equal to t is
not accepted) at most ⌊f·M⌋ impostors: the (⌊f·M⌋+1)-th largest impostor score; TAR is the
share of genuine pairs above it. Targets below 1/M are answered at FAR 0 (t = the largest
impostor score).

One pass over the upper triangle of the score matrix, block by block: only the scores above
a bound L are kept (L from a pilot sample of rows, set so that some 4·f·M impostors pass
it; when too few pass, the pass is repeated with a lower bound). Memory: two blocks (the next
block's GEMM runs while a thread sifts the last) plus 4 bytes per kept score, about 4·f_max·M
of them.
"""
import numpy as np

from .scan import (LocalComm, blocks, block_size, collect_above, count_at_rate, prepare_embeddings,
                   scan, DEFAULT_BLOCK_BYTES)

__all__ = ["ALLPAIRS_FARS", "pair_counts", "allpairs_tar_at_far"]

ALLPAIRS_FARS = (1e-4, 1e-5, 1e-6, 1e-7)


def pair_counts(labels):
    """(genuine, impostor) unordered pairs of `labels`."""
    _, counts = np.unique(np.asarray(labels).reshape(-1), return_counts=True)
    counts = counts.astype(object)  # exact integers
    n = int(counts.sum())
    genuine = int(sum(c * (c - 1) // 2 for c in counts))
    return genuine, n * (n - 1) // 2 - genuine


def _pilot_bound(x, codes, need, n_impostors, rng, margin=4.0, budget=4 << 20):
    """A score bound that about margin·need of the n_impostors impostor scores should pass:
    the matching quantile of the impostor scores of random rows (`budget` scores in all)
    against all rows."""
    n = len(x)
    pick = np.sort(rng.choice(n, min(n, max(16, budget // n)), replace=False))
    step = max(1, (1 << 20) // n)
    parts = []
    for lo in range(0, len(pick), step):
        p = pick[lo:lo + step]
        s = x[p] @ x.T
        parts.append(s[codes[p][:, None] != codes[None, :]])  # impostors only
    s = np.concatenate(parts)
    want = int(np.ceil(margin * need / max(n_impostors, 1) * len(s))) + 64
    if want >= len(s):
        return -np.inf
    return float(np.partition(s, len(s) - want)[len(s) - want])


def allpairs_tar_at_far(embeddings, labels, fars=ALLPAIRS_FARS, normalize=True,
                        block_bytes=DEFAULT_BLOCK_BYTES, comm=None, seed=0, stats=None):
    """{far: {"tar", "threshold", "false_accepts", "far" (achieved), "true_accepts"}} over all
    unordered pairs of `embeddings` [N, d] with identity `labels` [N] (see the module). The
    blocks are shared by the ranks of `comm` (every rank gets the result). `stats`, a dict,
    receives genuine/impostor counts, the bound, the kept scores, the scanned blocks and
    their GEMM flops."""
    comm = comm or LocalComm()
    x = prepare_embeddings(embeddings, normalize=normalize)
    labels = np.asarray(labels).reshape(-1)
    if len(labels) != len(x):
        raise ValueError(f"{len(labels)} labels for {len(x)} embeddings")
    _, codes = np.unique(labels, return_inverse=True)
    n = len(x)
    genuine, impostors = pair_counts(codes)
    if genuine == 0 or impostors == 0:
        raise ValueError(f"{genuine} genuine and {impostors} impostor pairs: TAR at FAR needs both")
    fars = [float(f) for f in fars]
    need = max(count_at_rate(f, impostors) for f in fars) + 1
    rows, cols = block_size(n, n, block_bytes)
    mine = blocks(n, n, rows, cols, upper=True, comm=comm)
    bound = float(comm.max(np.array([_pilot_bound(x, codes, min(need, impostors), impostors,
                                                  np.random.default_rng(seed))]))[0])
    margins = [16.0, 256.0, None]
    while True:
        imp, gen = [], []

        def consume(block, s):
            ri, ci, v = collect_above(s, bound, block[0], block[2], upper=True)
            same = codes[ri] == codes[ci]
            imp.append(v[~same])
            gen.append(v[same])

        scan(x, x, mine, consume, rows * cols)
        imp = np.concatenate(imp) if imp else np.zeros(0, np.float32)
        gen = np.concatenate(gen) if gen else np.zeros(0, np.float32)
        kept = int(comm.sum(np.array([len(imp)], np.int64))[0])
        if kept >= min(need, impostors) or bound == -np.inf:
            break
        margin = margins.pop(0)  # too few impostors passed the pilot's bound: lower it
        bound = -np.inf if margin is None else float(comm.max(np.array([_pilot_bound(
            x, codes, min(need, impostors), impostors, np.random.default_rng(seed + 1),
            margin)]))[0])
    # every rank's largest `need` impostors are enough to rank the global top `need`
    local = imp if len(imp) <= need else np.partition(imp, len(imp) - need)[len(imp) - need:]
    top = np.sort(comm.concat(local.astype(np.float32)))[::-1]
    out = {f: _at_rate(f, top, imp, gen, impostors, genuine, comm) for f in fars}
    if stats is not None:
        stats.update(genuine=genuine, impostors=impostors, bound=bound, kept=kept,
                     blocks=len(mine), block=(rows, cols),
                     flops=2.0 * x.shape[1] * sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in mine))
    return out


def _at_rate(f, top, imp, gen, impostors, genuine, comm):
    """The result at FAR `f`: the threshold from the global largest impostor scores `top`
    (descending), the accepts counted over every rank's kept scores `imp` and `gen`."""
    m = count_at_rate(f, impostors)
    t = -np.inf if m >= impostors else float(top[m])
    counts = comm.sum(np.array([np.count_nonzero(imp > t), np.count_nonzero(gen > t)], np.int64))
    fa, ta = int(counts[0]), int(counts[1])
    if t == -np.inf:
        fa, ta = impostors, genuine
    return {"tar": ta / genuine, "threshold": t, "false_accepts": fa, "far": fa / impostors,
            "true_accepts": ta}
