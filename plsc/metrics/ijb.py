"""IJB-B / IJB-C 1:1 template verification: template pooling, pair scores, ROC, TAR@FAR, AUC.

The protocol as insightface's evaluation script runs it by default: each image's
feature (the embedding of the aligned face plus that of its mirror image, not
normalised) is multiplied by its detector score; the features of one media (the
frames of a video, or a still) within a template are averaged; a template's media
features are summed and the sum L2-normalised; a pair's score is the cosine of
its two templates.
"""
import numpy as np

__all__ = ["FAR_TARGETS", "template_features", "pair_scores", "ijb_roc", "tar_at_far_nearest",
           "roc_auc", "ijb_report"]

FAR_TARGETS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


def template_features(features, templates, medias, det_scores=None, normalize_images=False):
    """(template ids [T] ascending, L2-normalised template features [T, d] float64).

    `features` [N, d] are the image features, `templates`/`medias` [N] their ids and
    `det_scores` [N] their detector scores (None: no weighting). With
    `normalize_images` each image feature is L2-normalised before the weighting. A
    template whose sum is zero keeps a zero feature (its pairs score 0).
    """
    x = np.array(features, dtype=np.float64)
    templates, medias = np.asarray(templates).reshape(-1), np.asarray(medias).reshape(-1)
    if x.ndim != 2 or len(x) != len(templates) or len(x) != len(medias):
        raise ValueError(f"features {x.shape} must be [N, d] with N = {len(templates)} templates "
                         f"and {len(medias)} medias")
    if normalize_images:
        x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    if det_scores is not None:
        x *= np.asarray(det_scores, np.float64).reshape(-1, 1)
    order = np.lexsort((medias, templates))
    t, m, x = templates[order], medias[order], x[order]
    new_media = np.r_[True, (t[1:] != t[:-1]) | (m[1:] != m[:-1])]
    starts = np.flatnonzero(new_media)
    media_mean = np.add.reduceat(x, starts, axis=0) / np.diff(np.r_[starts, len(x)])[:, None]
    media_template = t[starts]
    first = np.flatnonzero(np.r_[True, media_template[1:] != media_template[:-1]])
    pooled = np.add.reduceat(media_mean, first, axis=0)
    norm = np.linalg.norm(pooled, axis=1, keepdims=True)
    return media_template[first], pooled / np.where(norm > 0, norm, 1.0)


def pair_scores(template_ids, template_feats, pairs):
    """Cosine [P] of the pairs [P, 2] of template ids (rows of `template_feats`, whose ids
    `template_ids` are sorted ascending)."""
    pairs = np.asarray(pairs).reshape(-1, 2)
    rows = np.searchsorted(template_ids, pairs)
    rows = np.minimum(rows, len(template_ids) - 1)
    unknown = template_ids[rows] != pairs
    if unknown.any():
        raise ValueError(f"pair {int(np.argmax(unknown.any(1)))} names template "
                         f"{int(pairs[unknown][0])}, which has no image")
    return np.einsum("ij,ij->i", template_feats[rows[:, 0]], template_feats[rows[:, 1]])


def ijb_roc(scores, labels):
    """(FAR, TAR, thresholds) as ``sklearn.metrics.roc_curve(labels, scores)`` returns them
    (a pair is accepted when its score >= threshold): one point per distinct score, from
    the highest, after the first point (0, 0) at threshold +inf; interior points that
    lie on a straight line with equal steps on both sides are dropped
    (``drop_intermediate``), as in insightface's script."""
    scores, labels = np.asarray(scores, np.float64).reshape(-1), np.asarray(labels).reshape(-1) == 1
    if len(scores) != len(labels):
        raise ValueError(f"{len(scores)} scores for {len(labels)} labels")
    if labels.all() or not labels.any():
        raise ValueError("the ROC needs both positive (same) and negative (different) pairs")
    order = np.argsort(scores, kind="stable")[::-1]
    s, same = scores[order], labels[order]
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # last pair of each distinct score
    tp = np.cumsum(same)[last].astype(np.float64)
    fp = (last + 1) - tp
    thr = s[last]
    if len(tp) > 2:
        keep = np.r_[True, (np.diff(fp, 2) != 0) | (np.diff(tp, 2) != 0), True]
        tp, fp, thr = tp[keep], fp[keep], thr[keep]
    tp, fp, thr = np.r_[0.0, tp], np.r_[0.0, fp], np.r_[np.inf, thr]
    return fp / fp[-1], tp / tp[-1], thr


def tar_at_far_nearest(far, tar, far_targets=FAR_TARGETS):
    """{target: TAR} read off the ROC (`far`, `tar` in ROC order) as insightface does: the
    ROC point whose FAR is nearest the target (smallest |FAR − target|); among equally
    near points, the one with the largest TAR (the last in ROC order)."""
    far, tar = np.asarray(far, np.float64), np.asarray(tar, np.float64)
    out = {}
    for t in far_targets:
        gap = np.abs(far - t)
        out[float(t)] = float(tar[np.flatnonzero(gap == gap.min())[-1]])
    return out


def roc_auc(far, tar):
    """Area under the ROC by the trapezoidal rule (FAR ascending)."""
    far, tar = np.asarray(far, np.float64), np.asarray(tar, np.float64)
    return float(np.sum(np.diff(far) * (tar[1:] + tar[:-1]) / 2.0))


def ijb_report(features, templates, medias, pairs, labels, det_scores=None, normalize_images=False,
               far_targets=FAR_TARGETS):
    """Template verification of image `features` [N, d]: a dict with `tar_at_far`
    {FAR: TAR}, `auc`, the pair `scores` [P] and the ROC (`far`, `tar`)."""
    ids, feats = template_features(features, templates, medias, det_scores, normalize_images)
    scores = pair_scores(ids, feats, pairs)
    far, tar, _ = ijb_roc(scores, labels)
    return {"tar_at_far": tar_at_far_nearest(far, tar, far_targets), "auc": roc_auc(far, tar),
            "scores": scores, "far": far, "tar": tar, "num_templates": int(len(ids))}
