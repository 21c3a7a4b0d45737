"""All-pairs verification of a labelled embedding set (the task behind tools/eval_allpairs.py):
exact TAR at FAR 1e-4 … 1e-7 over every unordered pair, the score blocks shared by the ranks
(plsc.metrics.allpairs). Rank 0 prints the table and writes `allpairs_result.json` to
Global.output_dir."""
import os
import sys
import time

from .. import distributed as pd
from ..process import runtime
from ..data import DataError
from ..embedding import RankComm
from ..fileio import write_json
from ..metrics.allpairs import ALLPAIRS_FARS, allpairs_tar_at_far
from .arrays import load_embeddings, load_labels

__all__ = ["evaluate_allpairs", "format_allpairs_table"]


def format_allpairs_table(result):
    """TAR (%), the threshold and the false accepts at each target FAR."""
    lines = [f"all pairs: {result['num_images']} images, {result['genuine_pairs']} genuine and "
             f"{result['impostor_pairs']} impostor pairs (unordered, no self-pairs)",
             f"{'FAR':<10}{'TAR (%)':>10}{'threshold':>12}{'false acc.':>12}{'FAR reached':>13}"]
    for far, r in result["tar_at_far"].items():
        lines.append(f"{far:<10}{100 * r['tar']:>10.4f}{r['threshold']:>12.6f}{r['false_accepts']:>12}"
                     f"{r['far']:>13.3g}")
    return "\n".join(lines)


def evaluate_allpairs(cfg, embeddings, labels=None, fars=ALLPAIRS_FARS, normalize=True,
                      block_mb=64, out=None):
    """TAR at each FAR of `fars` over all pairs of the embeddings in `embeddings` (.npy [N, d])
    labelled by `labels` (.npy [N]; default `<stem>_labels.npy`, tools/extract.py's). Returns
    the result (on every rank)."""
    out = sys.stdout if out is None else out
    runtime.start(cfg)
    labels = labels or os.path.splitext(embeddings)[0] + "_labels.npy"
    x = load_embeddings(embeddings)
    y = load_labels(labels, len(x))
    stats = {}
    t0 = time.perf_counter()
    try:
        table = allpairs_tar_at_far(x, y, fars, normalize=normalize, block_bytes=int(block_mb) << 20,
                                    comm=RankComm(), stats=stats)
    except ValueError as err:
        raise DataError(f"{embeddings}: {err}") from None
    seconds = time.perf_counter() - t0
    result = {"num_images": len(x), "dim": int(x.shape[1]), "genuine_pairs": stats["genuine"],
              "impostor_pairs": stats["impostors"], "normalize": bool(normalize),
              "tar_at_far": {format(float(f), "g"): v for f, v in table.items()},
              "seconds": seconds, "world_size": pd.get_world_size()}
    if pd.get_rank() == 0:
        out_dir = cfg["Global"]["output_dir"]
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "allpairs_result.json")
        write_json(path, result)
        out.write(format_allpairs_table(result) + f"\nresult: {path}\n")
    return result
