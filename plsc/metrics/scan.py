"""The score scan behind identification, all-pairs verification and search: the score matrix
of two embedding sets computed block by block (float32 GEMM into one reused buffer), never
whole, with the per-block work fused into the same pass (a running top-k per row that looks
only at the rows whose block maximum beats their k-th best; a collection of the few scores
above a bound).

The ranks that share a scan talk through a `comm` object: `rank`, `world`, `sum(a)` (element-
wise over ranks), `max(a)`, `concat(a)` (1-D arrays of any length, in rank order).
`LocalComm` is the one-process one; `plsc.embedding.RankComm` the launched ranks' one.

Tie rule, everywhere: a score equal to a threshold is not accepted (accepted: score > t);
in a top-k, among equal scores the lower gallery index comes first.
"""
from fractions import Fraction
import math

import numpy as np

__all__ = ["LocalComm", "prepare_embeddings", "block_size", "blocks", "ScoreBuffer", "scan", "TopK",
           "collect_above",
           "count_at_rate", "threshold_at_rate"]

DEFAULT_BLOCK_BYTES = 64 << 20  # the score buffer of one block
_GROUPS = 256  # column groups of TopK's per-row bound


class LocalComm:
    """One process: every collective returns its input."""
    rank, world = 0, 1

    def sum(self, a):
        return np.asarray(a)

    def max(self, a):
        return np.asarray(a)

    def concat(self, a):
        return np.asarray(a)


def prepare_embeddings(x, name="embeddings", normalize=True):
    """`x` as a C-contiguous float32 [N, d] array, L2-normalised rows when `normalize` (a zero
    row stays zero); ValueError naming `name` when it is not [N, d] or not all finite."""
    x = np.asarray(x)
    if x.ndim != 2 or not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"{name}: shape {x.shape} ({x.dtype}), expected [N, d] numbers")
    converted = x.dtype != np.float32 or not x.flags.c_contiguous
    x = np.ascontiguousarray(x, dtype=np.float32)
    bad = ~np.isfinite(x).all(axis=1)
    if bad.any():
        raise ValueError(f"{name}: row {int(np.argmax(bad))} is not finite ({int(bad.sum())} rows "
                         "are not)")
    if normalize:
        norm = np.linalg.norm(x, axis=1, keepdims=True)
        norm = np.where(norm > 0, norm, 1).astype(np.float32)
        if converted:  # a copy already: normalise it in place
            x /= norm
        else:
            x = x / norm
    return x


def block_size(n_rows, n_cols, block_bytes=DEFAULT_BLOCK_BYTES):
    """(rows, cols) of a float32 score block within `block_bytes` (columns first, up to 8192)."""
    cols = max(1, min(n_cols, 8192, block_bytes // 4 // 256))
    rows = max(1, min(n_rows, block_bytes // 4 // cols))
    return rows, cols


def blocks(n_rows, n_cols, rows, cols, upper=False, comm=None):
    """The blocks (r0, r1, c0, c1) of this rank: row-major, round robin over ranks. With
    `upper` (a set against itself) only the blocks that meet the strict upper triangle."""
    comm = comm or LocalComm()
    out = [(r0, min(r0 + rows, n_rows), c0, min(c0 + cols, n_cols))
           for r0 in range(0, n_rows, rows) for c0 in range(0, n_cols, cols)
           if not upper or min(c0 + cols, n_cols) - 1 > r0]
    return out[comm.rank::comm.world]


class TopK:
    """The k best scores per query row and their gallery indices, updated block by block.

    `update(r0, c0, s)` merges block `s` (rows r0.., columns c0..): one compare keeps the scores
    above each row's current k-th best, and only those are merged. In a row's first block,
    where there is none yet, one pass takes the maxima of 256 column groups per row, whose
    k-th largest bounds the row's k-th best from below (about k candidates per row).
    Blocks must come in ascending column order within each row for the tie rule (equal
    scores: lower index first). `scores` [n, k] descending (-inf where fewer than k seen),
    `index` [n, k] (-1 there)."""

    def __init__(self, n, k):
        self.k = int(k)
        self.scores = np.full((n, self.k), -np.inf, np.float32)
        self.index = np.full((n, self.k), -1, np.int64)

    def update(self, r0, c0, s):
        k = self.k
        s = np.ascontiguousarray(s, dtype=np.float32)
        n, w = s.shape
        kth = self.scores[r0:r0 + n, k - 1]
        bar = np.nextafter(kth, np.float32(np.inf))  # s > kth exactly when s >= bar
        if w >= 2 * _GROUPS and k <= _GROUPS // 2 and np.isneginf(kth).any():
            # a row's first block: the k-th largest of _GROUPS column-group maxima is a lower
            # bound of its k-th largest score (later blocks compare with the running k-th best)
            w0 = w - w % _GROUPS
            gm = s[:, :w0].reshape(n, w0 // _GROUPS, _GROUPS).max(axis=1)
            bar = np.maximum(bar, np.partition(gm, _GROUPS - k, axis=1)[:, _GROUPS - k])
            m = s >= bar[:, None]
        else:
            m = s >= bar[:, None]
            if w > 4 * k and np.count_nonzero(m) > 8 * k * n:  # many candidates: the first blocks
                m &= s >= np.partition(s, w - k, axis=1)[:, w - k][:, None]
        flat = np.flatnonzero(m.reshape(-1))
        ri, ci = np.divmod(flat, w)
        self.merge(r0, c0, ri, ci, s.reshape(-1)[flat])

    def kth(self, r0, r1):
        """The current k-th best score of rows r0 … r1-1 (-inf while fewer than k are known)."""
        return self.scores[r0:r1, self.k - 1]

    def merge(self, r0, c0, ri, ci, vals):
        """Merge candidate scores `vals` at block rows `ri` (ascending; columns `ci` ascending within
        a row; global offsets r0, c0), found above the rows' k-th best by the caller's compare."""
        if not len(ri):
            return
        k = self.k
        first = np.r_[True, ri[1:] != ri[:-1]]
        rows = ri[first]                       # ascending: ri is
        pos = np.cumsum(first) - 1             # each candidate's place in `rows`
        g = rows + r0
        cand_r = np.concatenate([np.repeat(np.arange(len(rows)), k), pos])
        cand_s = np.concatenate([self.scores[g].reshape(-1), vals.astype(np.float32, copy=False)])
        cand_i = np.concatenate([self.index[g].reshape(-1), np.asarray(ci, np.int64) + c0])
        # order: row, score descending, in one stable sort of a 64-bit key (row, then the score's
        # bits flipped into descending order); among equal scores it keeps the kept entries (in
        # their order) before the candidates (in column order): index ascending
        order = np.argsort((cand_r.astype(np.uint64) << np.uint64(32)) | _descending_bits(cand_s),
                           kind="stable")
        cand_r = cand_r[order]
        starts = np.searchsorted(cand_r, np.arange(len(rows)))
        keep = (np.arange(len(order)) - starts[cand_r]) < k
        self.scores[g] = cand_s[order][keep].reshape(len(rows), k)
        self.index[g] = cand_i[order][keep].reshape(len(rows), k)


def _descending_bits(v):
    """uint64 keys of float32 `v` whose ascending order is v's descending order (-0.0 as 0.0)."""
    u = (np.asarray(v, np.float32) + np.float32(0.0)).view(np.uint32)
    flip = np.where(u >> np.uint32(31), np.uint32(0xFFFFFFFF), np.uint32(0x80000000))
    return (~(u ^ flip)).astype(np.uint64)


class ScoreBuffer:
    """One reused float32 buffer of `size` scores for the blocks of a scan."""

    def __init__(self, size):
        self.flat = np.empty(int(size), np.float32)

    def scores(self, a, b):
        """a @ b.T as a C-contiguous view of the buffer (no allocation)."""
        out = self.flat[:len(a) * len(b)].reshape(len(a), len(b))
        return np.matmul(a, b.T, out=out)


def scan(a, b, work, consume, size, overlap=True):
    """For each block (r0, r1, c0, c1) of `work`, in order: `consume(block, s)` with s = a[r0:r1]
    @ b[c0:c1].T (float32, C-contiguous, valid during the call). With `overlap`, two buffers of
    `size` scores: block i+1's GEMM runs while a worker thread consumes block i (one call at a
    time, in order, so `consume` needs no lock); its exceptions come through."""
    if not overlap:
        buf = ScoreBuffer(size)
        for r0, r1, c0, c1 in work:
            consume((r0, r1, c0, c1), buf.scores(a[r0:r1], b[c0:c1]))
        return
    from concurrent.futures import ThreadPoolExecutor
    bufs = (ScoreBuffer(size), ScoreBuffer(size))
    with ThreadPoolExecutor(1, thread_name_prefix="plsc-scan") as pool:
        pending = None
        for i, (r0, r1, c0, c1) in enumerate(work):
            s = bufs[i % 2].scores(a[r0:r1], b[c0:c1])
            if pending is not None:
                pending.result()
            pending = pool.submit(consume, (r0, r1, c0, c1), s)
        if pending is not None:
            pending.result()


def collect_above(s, bound, r0=0, c0=0, upper=False):
    """(rows, cols, scores) of the entries of the C-contiguous block `s` (global offsets r0,
    c0) above `bound`; with `upper`, only those with col > row."""
    flat = np.flatnonzero(s.reshape(-1) > bound)
    vals = s.reshape(-1)[flat]
    ri, ci = np.divmod(flat, s.shape[1])
    ri, ci = ri + r0, ci + c0
    if upper:
        keep = ci > ri
        ri, ci, vals = ri[keep], ci[keep], vals[keep]
    return ri, ci, vals


def count_at_rate(rate, n):
    """⌊rate · n⌋ computed exactly from the decimal `rate` (0.29 · 100 is 29, not 28)."""
    return int(math.floor(Fraction(repr(float(rate))) * int(n)))


def threshold_at_rate(top_values, n, rate):
    """The lowest threshold t (accept: score > t) at which at most ⌊rate·n⌋ of `n` impostor
    scores are accepted, given `top_values` (at least the ⌊rate·n⌋+1 largest of them, any
    order): the (⌊rate·n⌋+1)-th largest score, or -inf when ⌊rate·n⌋ ≥ n (all accepted)."""
    m = count_at_rate(rate, n)
    if m >= n:
        return -np.inf
    v = np.asarray(top_values)
    if len(v) <= m:
        raise ValueError(f"{len(v)} values given, the {m + 1}-th largest is needed")
    return float(np.partition(v, len(v) - 1 - m)[len(v) - 1 - m])
