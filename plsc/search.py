"""Gallery search over embeddings: an exact index (blocked float32 GEMM with a fused top-k,
plsc.metrics.scan) or, with the optional `faiss-cpu` (`pip install -e ".[search]"`), an IVF or
HNSW index; top-k queries with scores, the open-set threshold for a target FPIR, and the
overlap report of a training and a test set.

Scores are cosines (rows L2-normalised when the index is built, queries when searched) or,
with `normalize=False`, raw dot products. An index is one file written through plsc.fileio
(an .npz: the kind, the gallery ids, and the embeddings or faiss's serialised index).
"""
import numpy as np

from .fileio import write_npz
from .metrics.scan import (DEFAULT_BLOCK_BYTES, LocalComm, TopK, block_size, blocks, collect_above,
                           prepare_embeddings, scan, threshold_at_rate)

__all__ = ["KINDS", "SearchIndex", "build_index", "load_index", "recall_at_k", "open_set_threshold",
           "overlap_report"]

KINDS = ("exact", "ivf", "hnsw")
"""The index kinds of `build_index`: exact (plsc's blocked scan), IVF and HNSW (faiss-cpu)."""


def _faiss():
    try:
        import faiss
    except ImportError:
        raise ValueError("index kinds ivf and hnsw need faiss-cpu: pip install faiss-cpu "
                         "(or the plsc extra: pip install -e \".[search]\")") from None
    return faiss


class SearchIndex:
    """A gallery of embeddings (`ids`: one label per row, default 0..N-1) to query."""

    def __init__(self, kind, embeddings=None, ids=None, normalize=True, faiss_index=None, params=None):
        if kind not in KINDS:
            raise ValueError(f"index kind {kind!r}, expected one of {', '.join(KINDS)}")
        self.kind, self.normalize, self.params = kind, bool(normalize), dict(params or {})
        self.embeddings, self.faiss_index = embeddings, faiss_index
        n = len(embeddings) if embeddings is not None else faiss_index.ntotal
        self.ids = np.arange(n) if ids is None else np.asarray(ids).reshape(-1)
        if len(self.ids) != n:
            raise ValueError(f"{len(self.ids)} ids for {n} gallery embeddings")

    def __len__(self):
        return len(self.ids)

    def search(self, queries, k=10, block_bytes=DEFAULT_BLOCK_BYTES):
        """(scores [n, k] descending, gallery rows [n, k]) of each query's k best; -inf and -1
        where the gallery has fewer than k rows. Exact: among equal scores the lower row first."""
        q = prepare_embeddings(queries, "queries", self.normalize)
        k = int(k)
        if k < 1:
            raise ValueError(f"k = {k}, expected at least 1")
        if self.kind != "exact":
            if q.shape[1] != self.faiss_index.d:
                raise ValueError(f"queries are {q.shape[1]}-d, the index {self.faiss_index.d}-d")
            if self.kind == "ivf":
                self.faiss_index.nprobe = int(self.params.get("nprobe", 16))
            else:
                self.faiss_index.hnsw.efSearch = max(k, int(self.params.get("ef_search", 64)))
            scores, rows = self.faiss_index.search(q, k)
            scores = np.where(rows < 0, -np.inf, scores).astype(np.float32)
            return scores, rows.astype(np.int64)
        g = self.embeddings
        if q.shape[1] != g.shape[1]:
            raise ValueError(f"queries are {q.shape[1]}-d, the gallery {g.shape[1]}-d")
        top = TopK(len(q), k)
        rows_, cols = block_size(len(q), len(g), block_bytes)
        scan(q, g, blocks(len(q), len(g), rows_, cols), lambda b, s: top.update(b[0], b[2], s),
             rows_ * cols)
        return top.scores, top.index

    def save(self, path):
        """Write the index to `path` (.npz) through the atomic writer."""
        arrays = {"kind": np.array(self.kind), "ids": self.ids, "normalize": np.array(self.normalize),
                  "params": np.array(repr(sorted(self.params.items())))}
        if self.kind == "exact":
            arrays["embeddings"] = self.embeddings
        else:
            arrays["faiss"] = _faiss().serialize_index(self.faiss_index)
        write_npz(path, arrays)
        return path


def build_index(embeddings, ids=None, kind="exact", normalize=True, nlist=None, nprobe=16, hnsw_m=32,
                ef_search=64, seed=0):
    """A `SearchIndex` of `embeddings` [N, d]. ivf: an inverted file of `nlist` lists (default
    ~4·√N) trained on the gallery, `nprobe` lists searched; hnsw: a graph of `hnsw_m` links,
    `ef_search` candidates. ValueError for non-finite embeddings or a bad kind."""
    x = prepare_embeddings(embeddings, "gallery embeddings", normalize)
    if kind == "exact":
        return SearchIndex(kind, x, ids, normalize)
    if kind not in KINDS:
        raise ValueError(f"index kind {kind!r}, expected one of {', '.join(KINDS)}")
    faiss = _faiss()
    d = x.shape[1]
    if kind == "ivf":
        nlist = int(nlist or max(1, min(len(x) // 39, round(4 * np.sqrt(len(x))))))
        quantizer = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = int(seed)
        index.train(x)
        index.add(x)
        params = {"nlist": nlist, "nprobe": int(nprobe)}
    else:
        index = faiss.IndexHNSWFlat(d, int(hnsw_m), faiss.METRIC_INNER_PRODUCT)
        index.add(x)
        params = {"hnsw_m": int(hnsw_m), "ef_search": int(ef_search)}
    sidx = SearchIndex(kind, None, ids, normalize, index, params)
    sidx._keep = quantizer if kind == "ivf" else None  # the quantizer lives as long as the index
    return sidx


def load_index(path):
    """The `SearchIndex` saved at `path`; ValueError when it is not one."""
    import ast
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):  # a .npy array given as the index
            raise ValueError(f"an array of shape {z.shape}, expected an .npz that 'build' wrote")
        with z:
            kind, ids, normalize = str(z["kind"]), z["ids"], bool(z["normalize"])
            params = dict(ast.literal_eval(str(z["params"])))
            data = z["embeddings"] if kind == "exact" else z["faiss"]
    except (KeyError, ValueError, OSError, SyntaxError) as err:
        raise ValueError(f"{path}: not a plsc search index ({err})") from None
    if kind == "exact":
        return SearchIndex(kind, np.ascontiguousarray(data, np.float32), ids, normalize, params=params)
    return SearchIndex(kind, None, ids, normalize, _faiss().deserialize_index(data), params)


def recall_at_k(found, exact):
    """The mean share of each query's exact top-k rows [n, k] that `found` [n, k'] contains."""
    found, exact = np.asarray(found), np.asarray(exact)
    hits = [len(set(f.tolist()) & set(e.tolist()) - {-1}) / max(1, int((e >= 0).sum()))
            for f, e in zip(found, exact)]
    return float(np.mean(hits))


def open_set_threshold(index, nonmated, fpir):
    """The lowest threshold t at which at most ⌊fpir·n⌋ of the `n` non-mated queries (people not
    in the gallery, held out) have a top score above t (accept: score > t); and their top-1
    scores. Queries whose top score is above t are then accepted as identified."""
    top, _ = index.search(nonmated, 1)
    top = top[:, 0]
    return threshold_at_rate(top, len(top), fpir), top


def overlap_report(train_names=None, test_names=None, train=None, test=None, threshold=None,
                   train_labels=None, test_labels=None, normalize=True, block_bytes=DEFAULT_BLOCK_BYTES,
                   comm=None, max_pairs=100_000):
    """Identities shared by a training and a test set: `names` (identity names in both lists,
    sorted), and with embeddings (`train` [N, d], `test` [M, d]) and a `threshold`, the
    near-duplicates: every (test row, train row, score) above it (the first `max_pairs`, highest
    first, and their `count`), with the train labels they hit (`train_labels_hit`) so that
    those identities can be dropped from training."""
    comm = comm or LocalComm()
    report = {}
    if train_names is not None and test_names is not None:
        shared = sorted(set(map(str, train_names)) & set(map(str, test_names)))
        report["names"] = shared
        report["shared_names"] = len(shared)
    if train is not None and test is not None:
        if threshold is None:
            raise ValueError("near-duplicates need a score threshold")
        a = prepare_embeddings(test, "test embeddings", normalize)
        b = prepare_embeddings(train, "train embeddings", normalize)
        if a.shape[1] != b.shape[1]:
            raise ValueError(f"test embeddings are {a.shape[1]}-d, train embeddings {b.shape[1]}-d")
        rows, cols = block_size(len(a), len(b), block_bytes)
        found = []
        scan(a, b, blocks(len(a), len(b), rows, cols, comm=comm),
             lambda blk, s: found.append(np.stack(collect_above(s, threshold, blk[0], blk[2]), 1)),
             rows * cols)
        mine = np.concatenate(found) if found else np.zeros((0, 3))
        cat = [comm.concat(mine[:, i].astype(np.float64)) for i in range(3)]
        order = np.lexsort((cat[1], cat[0], -cat[2]))
        ti, tj, sc = cat[0][order].astype(np.int64), cat[1][order].astype(np.int64), cat[2][order]
        report["threshold"] = float(threshold)
        report["near_duplicates"] = int(len(sc))
        report["pairs"] = [{"test": int(i), "train": int(j), "score": float(s)}
                           for i, j, s in zip(ti[:max_pairs], tj[:max_pairs], sc[:max_pairs])]
        if train_labels is not None:
            tl = np.asarray(train_labels).reshape(-1)
            report["train_labels_hit"] = sorted(set(tl[tj].tolist()))
            if test_labels is not None:
                sl = np.asarray(test_labels).reshape(-1)
                report["label_pairs"] = sorted({(str(x), str(y)) for x, y in zip(sl[ti], tl[tj])})
    return report
