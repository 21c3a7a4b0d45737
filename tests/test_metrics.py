"""Verification metrics against brute-force loops written independently here."""
import numpy as np
import pytest

from plsc.metrics import kfold_accuracy, pair_distances, tar_at_far, verification_report


def brute_kfold(dist, issame, n_folds, thresholds):
    n = len(dist)
    bounds = [round(i * n / n_folds) for i in range(n_folds + 1)]  # equal contiguous folds here
    accs = []
    for f in range(n_folds):
        test = set(range(bounds[f], bounds[f + 1]))
        best_t, best_correct = None, -1
        for t in thresholds:
            correct = sum((dist[i] < t) == issame[i] for i in range(n) if i not in test)
            if correct > best_correct:
                best_t, best_correct = t, correct
        accs.append(sum((dist[i] < best_t) == issame[i] for i in test) / len(test))
    return np.array(accs)


def test_kfold_accuracy_matches_brute_force():
    rng = np.random.RandomState(0)
    issame = rng.rand(200) < 0.5
    dist = np.where(issame, rng.normal(0.8, 0.3, 200), rng.normal(1.6, 0.3, 200)).clip(0, 4)
    thresholds = np.arange(0.0, 4.0, 0.05)
    accs, _ = kfold_accuracy(dist, issame, 10, thresholds)
    np.testing.assert_allclose(accs, brute_kfold(dist, issame, 10, thresholds))


def test_tar_at_far_matches_brute_force():
    rng = np.random.RandomState(1)
    issame = rng.rand(3000) < 0.3
    dist = np.where(issame, rng.normal(0.7, 0.3, 3000), rng.normal(1.5, 0.3, 3000))
    got = tar_at_far(dist, issame, (1e-1, 1e-2, 1e-3))
    neg, pos = dist[~issame], dist[issame]
    for target, value in got.items():
        best = 0.0
        for t in np.unique(dist):
            if np.mean(neg <= t) <= target:
                best = max(best, float(np.mean(pos <= t)))
        assert value == pytest.approx(best, abs=1e-12), target


def test_report_on_separable_pairs_and_flip_sum():
    rng = np.random.RandomState(2)
    base = rng.normal(size=(50, 16))
    imgs = []
    issame = np.arange(50) % 2 == 0
    for i in range(50):
        other = base[i] + 0.05 * rng.normal(size=16) if issame[i] else rng.normal(size=16)
        imgs += [base[i], other]
    emb = np.array(imgs)
    rep = verification_report(emb, issame, flipped=emb)
    assert rep["accuracy"] == 1.0 and rep["num_pairs"] == 50
    assert rep["embedding_norm"] == pytest.approx(np.linalg.norm(emb, axis=1).mean())
    d = pair_distances(emb)
    assert d[issame].max() < d[~issame].min()


def test_flipped_embeddings_are_added_before_normalising():
    """Each image's embedding is identity + a large nuisance, its flip's identity - nuisance:
    only the flip-sum (insightface's protocol) separates the pairs. The report must match
    the brute-force protocol on the flip-summed embeddings, and differ from the raw ones."""
    rng = np.random.RandomState(7)
    pairs, d = 60, 16
    issame = rng.rand(pairs) < 0.5
    ident = rng.normal(size=(pairs, d))
    first = ident
    second = np.where(issame[:, None], ident + 0.05 * rng.normal(size=(pairs, d)),
                      rng.normal(size=(pairs, d)))
    identity = np.stack([first, second], axis=1).reshape(2 * pairs, d)
    nuisance = 6.0 * rng.normal(size=(2 * pairs, d))
    emb, flipped = identity + nuisance, identity - nuisance

    def distances(e):  # written here: squared distance of the L2-normalised pair members
        u = e / np.sqrt((e * e).sum(axis=1, keepdims=True))
        return ((u[0::2] - u[1::2]) ** 2).sum(axis=1)

    thresholds = np.arange(0.0, 4.0, 0.01)
    summed = brute_kfold(distances(emb + flipped), issame, 10, thresholds).mean()
    raw = brute_kfold(distances(emb), issame, 10, thresholds).mean()
    assert summed == 1.0 and raw < 0.85  # the data: the flip decides
    rep = verification_report(emb, issame, flipped=flipped)
    assert rep["accuracy"] == pytest.approx(summed, abs=1e-12)
    assert verification_report(emb, issame)["accuracy"] == pytest.approx(raw, abs=1e-12)
    assert rep["embedding_norm"] == pytest.approx(np.linalg.norm(emb, axis=1).mean(), rel=1e-12)


def test_fold_errors():
    with pytest.raises(ValueError, match="5 pairs cannot be split into 10 folds"):
        kfold_accuracy(np.zeros(5), np.zeros(5, bool))
