"""The tasks behind tools/search.py: build a gallery index from embeddings, query it (the
queries shared by the ranks), choose the open-set threshold for a target FPIR, and report the
overlap of a training and a test set (plsc.search)."""
import os
import sys

import numpy as np

from .. import distributed as pd
from ..process import runtime
from ..data import DataError
from ..embedding import RankComm, gather_shares, rank_share
from ..fileio import write_json, write_npz
from ..search import build_index, load_index, open_set_threshold, overlap_report
from .arrays import load_embeddings, load_labels

__all__ = ["build", "query", "threshold", "overlap", "read_names"]


def _labels_beside(path, rows, labels=None):
    """`labels` (.npy) or `<stem>_labels.npy` beside `path` when it exists, else None."""
    guess = os.path.splitext(path)[0] + "_labels.npy"
    if labels is None and os.path.isfile(guess):
        labels = guess
    return None if labels is None else load_labels(labels, rows)


def _data_errors(fn, what):
    try:
        return fn()
    except ValueError as err:
        raise DataError(f"{what}: {err}") from None


def build(cfg, embeddings, index_path, ids=None, kind="exact", normalize=True, nlist=None, nprobe=16,
          hnsw_m=32, ef_search=64, out=None):
    """Write the index of the gallery `embeddings` (.npy; ids: `ids` .npy or `<stem>_labels.npy`,
    else row numbers) to `index_path` (rank 0). Returns the index."""
    out = sys.stdout if out is None else out
    runtime.start(cfg)
    x = load_embeddings(embeddings, what="gallery embeddings")
    y = _labels_beside(embeddings, len(x), ids)
    index = _data_errors(lambda: build_index(x, y, kind, normalize, nlist, nprobe, hnsw_m, ef_search),
                         embeddings)
    if pd.get_rank() == 0:
        index.save(index_path)
        out.write(f"{kind} index of {len(index)} embeddings ({x.shape[1]}-d): {index_path}\n")
    return index


def _open(index_path):
    if not os.path.isfile(index_path):
        raise FileNotFoundError(f"index file {index_path} does not exist")
    try:
        return load_index(index_path)
    except ValueError as err:  # its message names the file
        raise DataError(str(err)) from None


def threshold(cfg, index_path, nonmated, fpir, out=None):
    """The open-set threshold at `fpir` from the non-mated queries `nonmated` (.npy: people not
    in the gallery). Returns (threshold, FPIR reached)."""
    out = sys.stdout if out is None else out
    runtime.start(cfg)
    index = _open(index_path)
    q = load_embeddings(nonmated, what="non-mated queries")
    t, top = _data_errors(lambda: open_set_threshold(index, q, fpir), nonmated)
    reached = float(np.mean(top > t))
    if pd.get_rank() == 0:
        out.write(f"threshold {t:.6f} at FPIR {fpir:g}: {int((top > t).sum())} of {len(top)} non-mated "
                  f"queries have a top score above it (FPIR reached {reached:.4g})\n")
    return t, reached


def query(cfg, index_path, queries, output, k=10, threshold_value=None, nonmated=None, fpir=None,
          out=None):
    """Each query's top-k (scores, gallery rows and ids) to `output` (.npz), each rank searching
    its share of the queries. With a threshold (given, or chosen from `nonmated` at `fpir`),
    `accepted`: top score above it. Returns the arrays."""
    out = sys.stdout if out is None else out
    runtime.start(cfg)
    index = _open(index_path)
    q = load_embeddings(queries, what="queries")
    if nonmated is not None:
        threshold_value, _ = threshold(cfg, index_path, nonmated, fpir, out=out)
    start, stop, _ = rank_share(len(q))
    scores, rows = _data_errors(lambda: index.search(q[start:stop], k), queries)
    scores = gather_shares(scores, len(q))
    rows = gather_shares(rows, len(q))
    result = {"scores": scores, "rows": rows, "ids": np.where(rows >= 0, index.ids[np.maximum(rows, 0)], -1)
              if np.issubdtype(index.ids.dtype, np.number) else index.ids[np.maximum(rows, 0)]}
    if threshold_value is not None:
        result["threshold"] = np.float64(threshold_value)
        result["accepted"] = scores[:, 0] > threshold_value
    if pd.get_rank() == 0:
        write_npz(output, result)
        msg = f"top-{k} of {len(q)} queries in a {index.kind} index of {len(index)}: {output}"
        if threshold_value is not None:
            msg += f"; {int(result['accepted'].sum())} above the threshold {threshold_value:.6f}"
        out.write(msg + "\n")
    return result


def read_names(source):
    """Identity names: the sub-folders of a folder (an image-folder dataset), or the lines of a
    text file (one name per line; blank lines skipped)."""
    if os.path.isdir(source):
        return sorted(e.name for e in os.scandir(source) if e.is_dir())
    if not os.path.isfile(source):
        raise FileNotFoundError(f"{source} does not exist (expected a folder of identity folders or "
                                "a text file of names)")
    with open(source, encoding="utf-8", errors="replace") as f:
        return [line.strip() for line in f if line.strip()]


def overlap(cfg, output, train_names=None, test_names=None, train=None, test=None, threshold_value=None,
            train_labels=None, test_labels=None, normalize=True, out=None):
    """The overlap report (plsc.search.overlap_report) to `output` (.json): shared identity names
    and, with embeddings and a threshold, the near-duplicate pairs (the ranks share the
    blocks). Returns the report."""
    out = sys.stdout if out is None else out
    runtime.start(cfg)
    a = read_names(train_names) if train_names else None
    b = read_names(test_names) if test_names else None
    x = y = xl = yl = None
    if train or test:
        if not (train and test and threshold_value is not None):
            raise DataError("near-duplicates need --train-embeddings, --test-embeddings and --threshold")
        x = load_embeddings(train, what="train embeddings")
        y = load_embeddings(test, what="test embeddings")
        xl, yl = _labels_beside(train, len(x), train_labels), _labels_beside(test, len(y), test_labels)
    report = _data_errors(lambda: overlap_report(a, b, x, y, threshold_value, xl, yl, normalize,
                                                 comm=RankComm()), train or "overlap")
    if "label_pairs" in report:
        report["label_pairs"] = [list(p) for p in report["label_pairs"]]
    if "train_labels_hit" in report:
        report["train_labels_hit"] = [v if isinstance(v, str) else int(v) for v in report["train_labels_hit"]]
    if pd.get_rank() == 0:
        write_json(output, report)
        parts = []
        if "shared_names" in report:
            parts.append(f"{report['shared_names']} identity names in both")
        if "near_duplicates" in report:
            parts.append(f"{report['near_duplicates']} test/train pairs above {threshold_value:g}"
                         + (f" ({len(report['train_labels_hit'])} training identities)"
                            if "train_labels_hit" in report else ""))
        out.write("; ".join(parts) + f": {output}\n")
    return report
