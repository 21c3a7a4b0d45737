"""IJB template pooling, pair scores, ROC, TAR@FAR and AUC against brute-force oracles."""
import math

import numpy as np
import pytest

from plsc.metrics import (FAR_TARGETS, ijb_report, ijb_roc, pair_scores, roc_auc, tar_at_far_nearest,
                          template_features)


def _protocol(seed=0, n=80, d=8, num_templates=12):
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(n, d)) * rng.uniform(0.2, 3.0, (n, 1))
    ids = rng.choice(np.arange(1, 1000), num_templates, replace=False)
    templates = ids[rng.integers(0, num_templates, n)]
    templates[:num_templates] = ids                       # every template has an image
    medias = rng.integers(1, 6, n)                        # media ids shared across templates
    scores = rng.uniform(0.1, 1.0, n)
    pairs = np.array([(a, b) for i, a in enumerate(ids) for b in ids[i + 1:]])
    labels = rng.integers(0, 2, len(pairs))
    return features, templates, medias, scores, pairs, labels


def _brute_templates(features, templates, medias, scores, normalize_images):
    """Plain loops: per template, per media the mean of its (weighted) image features; their
    sum, L2-normalised."""
    out = {}
    for t in sorted(set(templates.tolist())):
        by_media = {}
        for i in range(len(features)):
            if templates[i] != t:
                continue
            f = [float(v) for v in features[i]]
            if normalize_images:
                norm = math.sqrt(sum(v * v for v in f))
                f = [v / norm for v in f]
            if scores is not None:
                f = [v * float(scores[i]) for v in f]
            by_media.setdefault(int(medias[i]), []).append(f)
        total = [0.0] * features.shape[1]
        for rows in by_media.values():
            for k in range(len(total)):
                total[k] += sum(r[k] for r in rows) / len(rows)
        norm = math.sqrt(sum(v * v for v in total))
        out[t] = [v / norm for v in total]
    return out


def _brute_roc(scores, labels):
    """Every distinct score as a threshold (accept >= threshold), from the highest."""
    pos, neg = sum(1 for v in labels if v == 1), sum(1 for v in labels if v == 0)
    far, tar = [0.0], [0.0]
    for thr in sorted(set(scores.tolist()), reverse=True):
        tp = sum(1 for s, v in zip(scores, labels) if s >= thr and v == 1)
        fp = sum(1 for s, v in zip(scores, labels) if s >= thr and v == 0)
        far.append(fp / neg)
        tar.append(tp / pos)
    return far, tar


def _insightface_tar(fpr, tpr, target):
    """The rule of insightface's eval script, literally: flip the ROC, take the smallest
    (|fpr - target|, index)."""
    fpr, tpr = np.flipud(fpr), np.flipud(tpr)
    _, i = min(zip(abs(fpr - target), range(len(fpr))))
    return tpr[i]


@pytest.mark.parametrize("weighted,normalize_images", [(True, False), (False, False), (True, True)])
def test_template_features_and_pair_scores_match_loops(weighted, normalize_images):
    features, templates, medias, scores, pairs, _ = _protocol()
    ids, feats = template_features(features, templates, medias, scores if weighted else None,
                                   normalize_images)
    expect = _brute_templates(features, templates, medias, scores if weighted else None, normalize_images)
    assert ids.tolist() == sorted(expect)
    np.testing.assert_allclose(feats, [expect[t] for t in ids.tolist()], rtol=0, atol=1e-9)
    cos = pair_scores(ids, feats, pairs)
    brute = [sum(x * y for x, y in zip(expect[a], expect[b])) for a, b in pairs.tolist()]
    np.testing.assert_allclose(cos, brute, rtol=0, atol=1e-9)


def test_detector_score_weighting_changes_the_scores():
    features, templates, medias, scores, pairs, labels = _protocol(1)
    on = ijb_report(features, templates, medias, pairs, labels, scores)["scores"]
    off = ijb_report(features, templates, medias, pairs, labels, None)["scores"]
    assert np.abs(on - off).max() > 1e-3


def test_roc_tar_and_auc_match_brute_force():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 2, 400)
    scores = rng.normal(size=400) + 1.2 * labels
    far, tar, thr = ijb_roc(scores, labels)
    bfar, btar = _brute_roc(scores, labels)
    # the brute-force ROC has every point; ours drops interior points of straight runs only
    points = set(zip(np.round(bfar, 12), np.round(btar, 12)))
    assert set(zip(np.round(far, 12), np.round(tar, 12))) <= points
    fars = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 0.3, 0.5)
    got = tar_at_far_nearest(far, tar, fars)
    for t in fars:  # nearest FAR among all points, ties to the larger TAR
        best = min(range(len(bfar)), key=lambda i: (abs(bfar[i] - t), -btar[i]))
        assert got[t] == pytest.approx(btar[best], abs=1e-12)
    area = sum((bfar[i + 1] - bfar[i]) * (btar[i + 1] + btar[i]) / 2 for i in range(len(bfar) - 1))
    assert roc_auc(far, tar) == pytest.approx(area, abs=1e-12)
    accepted = [sum(1 for s in scores if s >= t) for t in thr[1:]]
    assert accepted == sorted(accepted)


def test_tar_rule_prefers_the_larger_tar_on_a_tie():
    far = np.array([0.0, 0.0, 0.5e-4, 0.5e-4, 1.5e-4, 1.0])
    tar = np.array([0.0, 0.2, 0.3, 0.4, 0.6, 1.0])
    got = tar_at_far_nearest(far, tar, (1e-4, 0.0, 0.6))
    assert got == {1e-4: 0.6, 0.0: 0.2, 0.6: 1.0}


@pytest.mark.parametrize("decimals", [None, 1, 2])
def test_roc_and_tar_agree_with_sklearn_and_insightface_rule(decimals):
    """Rounded scores make ties (diagonal ROC steps, dropped collinear points)."""
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 2, 3000)
    scores = rng.normal(size=3000) * 0.3 + 0.4 * labels
    if decimals is not None:
        scores = np.round(scores, decimals)
    far, tar, thr = ijb_roc(scores, labels)
    sfar, star, sthr = metrics.roc_curve(labels, scores)
    np.testing.assert_array_equal(far, sfar)
    np.testing.assert_array_equal(tar, star)
    np.testing.assert_array_equal(thr, sthr)
    got = tar_at_far_nearest(far, tar, FAR_TARGETS + (0.25,))
    for t, value in got.items():
        assert value == _insightface_tar(sfar, star, t)
    assert roc_auc(far, tar) == pytest.approx(metrics.auc(sfar, star), abs=1e-12)


def test_report_on_the_whole_protocol_matches_the_oracles():
    metrics = pytest.importorskip("sklearn.metrics")
    features, templates, medias, scores, pairs, labels = _protocol(5, n=200, num_templates=40)
    report = ijb_report(features, templates, medias, pairs, labels, scores)
    expect = _brute_templates(features, templates, medias, scores, False)
    brute = np.array([sum(x * y for x, y in zip(expect[a], expect[b])) for a, b in pairs.tolist()])
    np.testing.assert_allclose(report["scores"], brute, atol=1e-9)
    sfar, star, _ = metrics.roc_curve(labels, brute)
    for t in FAR_TARGETS:
        assert report["tar_at_far"][t] == pytest.approx(_insightface_tar(sfar, star, t), abs=1e-6)
    assert report["auc"] == pytest.approx(metrics.auc(sfar, star), abs=1e-6)
    assert report["num_templates"] == 40


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="both positive"):
        ijb_roc([0.1, 0.2], [1, 1])
    with pytest.raises(ValueError, match="template 77"):
        pair_scores(np.array([1, 2]), np.eye(2), np.array([[1, 77]]))
    with pytest.raises(ValueError, match=r"\[N, d\]"):
        template_features(np.zeros((3, 2)), [1, 2], [1, 2])
