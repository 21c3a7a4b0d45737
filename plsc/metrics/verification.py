"""Face-verification metrics: 10-fold accuracy with a learned threshold, TAR@FAR.

The protocol of LFW, CFP-FP and AgeDB-30 as insightface reports it: each
image's embedding is the sum of the embeddings of the image and its
horizontal flip, L2-normalised; a pair is scored by the squared distance of
its two embeddings; in each of 10 folds the threshold that is best on the
other 9 folds is applied to the tenth.
"""
import numpy as np

__all__ = ["FOLDS", "pair_distances", "kfold_accuracy", "tar_at_far", "roc_curve", "verification_report"]

THRESHOLDS = np.arange(0.0, 4.0, 0.01)  # squared distances of unit vectors lie in [0, 4]


def _l2_normalize(x):
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def pair_distances(embeddings):
    """Squared distances of pairs (rows 2i and 2i+1) of L2-normalised embeddings."""
    e = _l2_normalize(embeddings)
    return np.sum((e[0::2] - e[1::2]) ** 2, axis=1)


def _accuracy(dist, issame, threshold):
    return float(np.mean((dist < threshold) == issame))


FOLDS = 10
"""The folds of the verification accuracy (the LFW protocol's ten); a pack needs as many pairs."""


def kfold_accuracy(dist, issame, n_folds=FOLDS, thresholds=THRESHOLDS):
    """(accuracies per fold, chosen threshold per fold); folds are contiguous, unshuffled."""
    dist, issame = np.asarray(dist), np.asarray(issame, dtype=bool)
    if len(dist) != len(issame):
        raise ValueError(f"{len(dist)} distances for {len(issame)} pair labels")
    if len(dist) < n_folds:
        raise ValueError(f"{len(dist)} pairs cannot be split into {n_folds} folds")
    folds = np.array_split(np.arange(len(dist)), n_folds)
    accs, chosen = [], []
    for test in folds:
        train = np.setdiff1d(np.arange(len(dist)), test)
        train_acc = [_accuracy(dist[train], issame[train], t) for t in thresholds]
        best = thresholds[int(np.argmax(train_acc))]
        chosen.append(float(best))
        accs.append(_accuracy(dist[test], issame[test], best))
    return np.array(accs), np.array(chosen)


def roc_curve(dist, issame):
    """(false accept rate, true accept rate, thresholds) over every distinct distance."""
    dist, issame = np.asarray(dist), np.asarray(issame, dtype=bool)
    order = np.argsort(dist, kind="stable")
    d, same = dist[order], issame[order]
    # Accept pairs with distance <= threshold; evaluate at each distinct distance.
    last = np.r_[np.nonzero(np.diff(d))[0], len(d) - 1]
    tp, fp = np.cumsum(same)[last], np.cumsum(~same)[last]
    n_pos, n_neg = max(int(same.sum()), 1), max(int((~same).sum()), 1)
    return np.r_[0.0, fp / n_neg], np.r_[0.0, tp / n_pos], np.r_[-np.inf, d[last]]


def tar_at_far(dist, issame, far_targets=(1e-2, 1e-3, 1e-4)):
    """Highest true accept rate whose false accept rate does not exceed each target.

    With M negative pairs the smallest non-zero FAR is 1/M: targets below it
    are answered at FAR 0.
    """
    far, tar, _ = roc_curve(dist, issame)
    return {float(t): float(tar[far <= t].max()) for t in far_targets}


def verification_report(embeddings, issame, flipped=None, n_folds=FOLDS, with_roc=False):
    """Accuracy ± std, threshold, TAR@FAR and mean embedding norm of one pack.

    `embeddings` are the 2P raw embeddings of the pack's images in pair order;
    `flipped` (optional) those of their horizontal flips, added before normalising.
    With `with_roc`, the report also holds the ROC curve (`far`, `tar` arrays).
    """
    emb = np.asarray(embeddings, dtype=np.float64)
    norm = float(np.linalg.norm(emb, axis=1).mean())
    if flipped is not None:
        emb = emb + np.asarray(flipped, dtype=np.float64)
    dist = pair_distances(emb)
    accs, thresholds = kfold_accuracy(dist, issame, n_folds)
    report = {"accuracy": float(accs.mean()), "accuracy_std": float(accs.std()),
              "threshold": float(thresholds.mean()), "embedding_norm": norm,
              "tar_at_far": tar_at_far(dist, issame), "num_pairs": int(len(dist))}
    if with_roc:
        report["far"], report["tar"], _ = roc_curve(dist, issame)
    return report
