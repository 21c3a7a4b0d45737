"""Class-centre sampling: positives kept, negatives uniform, sizes as the formula says."""
import numpy as np
import pytest

from plsc.nn.sampling import num_sampled, sample_centres


def chi_square_limit(df, z=3.09):
    """Upper 0.1% point of chi-square(df), Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * np.sqrt(a)) ** 3


@pytest.mark.parametrize("ratio", [0.05, 0.3, 0.9])
def test_positives_kept_sorted_unique_and_remapped(ratio):
    rng = np.random.RandomState(0)
    num_local = 200
    for step in range(20):
        target = rng.randint(-1, num_local, 64)
        index, remapped = sample_centres(target, num_local, ratio, seed=1, step=step, rank=0)
        positives = np.unique(target[target >= 0])
        assert set(positives) <= set(index)
        assert np.all(np.diff(index) > 0) and index.min() >= 0 and index.max() < num_local
        assert len(index) == max(int(ratio * num_local), len(positives))
        owned = target >= 0
        np.testing.assert_array_equal(index[remapped[owned]], target[owned])
        assert np.all(remapped[~owned] == -1)


def test_num_sample_when_positives_exceed_the_ratio():
    target = np.arange(50)  # 50 distinct positives, ratio would give 10
    index, _ = sample_centres(target, 100, 0.1, seed=0, step=0, rank=0)
    np.testing.assert_array_equal(index, np.arange(50))
    assert num_sampled(100, 0.1, 50) == 50 and num_sampled(100, 0.1, 3) == 10


def test_negatives_are_uniform():
    num_local, ratio, draws = 60, 0.25, 4000
    target = np.array([3, 17, 17, 42, -1, -1])
    positives = {3, 17, 42}
    counts = np.zeros(num_local)
    for step in range(draws):
        index, _ = sample_centres(target, num_local, ratio, seed=7, step=step, rank=1)
        counts[index] += 1
    assert all(counts[p] == draws for p in positives)
    neg = np.array([c for i, c in enumerate(counts) if i not in positives])
    expected = draws * (int(ratio * num_local) - len(positives)) / len(neg)
    stat = float(((neg - expected) ** 2 / expected).sum())
    assert stat < chi_square_limit(len(neg) - 1), stat


def test_draw_is_a_function_of_seed_step_and_rank():
    target = np.array([1, 5, -1])
    draw = lambda **kw: sample_centres(target, 1000, 0.1, **kw)[0]  # noqa: E731
    np.testing.assert_array_equal(draw(seed=0, step=4, rank=1), draw(seed=0, step=4, rank=1))
    for other in (dict(seed=1, step=4, rank=1), dict(seed=0, step=5, rank=1),
                  dict(seed=0, step=4, rank=0)):
        assert not np.array_equal(draw(seed=0, step=4, rank=1), draw(**other))


def test_ratio_one_uses_every_class():
    index, remapped = sample_centres(np.array([4, -1, 0]), 9, 1.0, seed=0, step=0, rank=0)
    np.testing.assert_array_equal(index, np.arange(9))
    np.testing.assert_array_equal(remapped, [4, -1, 0])
