"""Class-centre sampling: positives kept, negatives uniform, sizes as the formula says."""
import numpy as np
import paddle
import pytest

from plsc.nn.sampling import num_sampled, sample_centres

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets


def chi_square_limit(df, z=3.09):
    """Upper 0.1% point of chi-square(df), Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * np.sqrt(a)) ** 3


def draw(target, num_local, ratio, seed=0, step=0, rank=0):
    index, remapped = sample_centres(paddle.to_tensor(np.asarray(target, dtype=np.int64)),
                                     num_local, ratio, seed, step, rank)
    return index.numpy(), remapped.numpy()


# 200 classes: every class is a candidate; 5000 classes: the Bernoulli-process path.
@pytest.mark.parametrize("num_local", [200, 5000])
@pytest.mark.parametrize("ratio", [0.05, 0.3, 0.9])
def test_positives_kept_sorted_unique_and_remapped(ratio, num_local):
    rng = np.random.RandomState(0)
    for step in range(20):
        target = rng.randint(-1, num_local, 64)
        target[:8] = target[8:16]  # repeated labels
        index, remapped = draw(target, num_local, ratio, seed=1, step=step)
        positives = np.unique(target[target >= 0])
        assert set(positives) <= set(index)
        assert np.all(np.diff(index) > 0) and index.min() >= 0 and index.max() < num_local
        assert len(index) == max(int(ratio * num_local), len(positives))
        owned = target >= 0
        np.testing.assert_array_equal(index[remapped[owned]], target[owned])
        assert np.all(remapped[~owned] == -1)


def test_num_sample_when_positives_exceed_the_ratio():
    target = np.arange(50)  # 50 distinct positives, ratio would give 10
    index, _ = draw(target, 100, 0.1)
    np.testing.assert_array_equal(index, np.arange(50))
    assert num_sampled(100, 0.1, 50) == 50 and num_sampled(100, 0.1, 3) == 10


@pytest.mark.parametrize("num_local, ratio, draws", [(60, 0.25, 4000), (3000, 0.03, 600)])
def test_negatives_are_uniform(num_local, ratio, draws):
    target = np.array([3, 17, 17, 42, -1, -1])
    positives = {3, 17, 42}
    counts = np.zeros(num_local)
    for step in range(draws):
        index, _ = draw(target, num_local, ratio, seed=7, step=step, rank=1)
        counts[index] += 1
    assert all(counts[p] == draws for p in positives)
    neg = np.array([c for i, c in enumerate(counts) if i not in positives])
    expected = draws * (int(ratio * num_local) - len(positives)) / len(neg)
    stat = float(((neg - expected) ** 2 / expected).sum())
    assert stat < chi_square_limit(len(neg) - 1), stat


def test_negatives_are_a_uniform_subset_jointly():
    """Beyond each class's frequency: how many negatives fall in the lower half, and how
    many neighbouring pairs are both drawn, follow the laws of a uniform k-subset."""
    m, k, draws = 4000, 120, 600  # no positives: every class is a negative
    lower, pairs = [], []
    for step in range(draws):
        index, _ = draw([-1, -1], m, k / m, seed=3, step=step, rank=2)
        assert len(index) == k
        lower.append(np.sum(index < m // 2))
        pairs.append(np.sum(np.diff(index) == 1))
    half = m // 2  # hypergeometric: k draws from m with `half` marked
    mean = k * half / m
    var = k * (half / m) * (1 - half / m) * (m - k) / (m - 1)
    assert abs(np.mean(lower) - mean) < 5 * np.sqrt(var / draws)
    p_pair = k * (k - 1) / (m * (m - 1))  # both of a given neighbouring pair drawn
    mean_pairs = (m - 1) * p_pair
    assert abs(np.mean(pairs) - mean_pairs) < 5 * np.sqrt(mean_pairs / draws)


def test_draw_is_a_function_of_seed_step_and_rank():
    target = np.array([1, 5, -1])
    pick = lambda **kw: draw(target, 1000, 0.1, **kw)[0]  # noqa: E731
    np.testing.assert_array_equal(pick(seed=0, step=4, rank=1), pick(seed=0, step=4, rank=1))
    for other in (dict(seed=1, step=4, rank=1), dict(seed=0, step=5, rank=1),
                  dict(seed=0, step=4, rank=0)):
        assert not np.array_equal(pick(seed=0, step=4, rank=1), pick(**other))


def test_draw_leaves_the_global_generator_alone():
    paddle.seed(11)
    expected = paddle.rand([4]).numpy()
    paddle.seed(11)
    draw([2, -1], 5000, 0.1, seed=9, step=3)
    np.testing.assert_array_equal(paddle.rand([4]).numpy(), expected)


def test_ratio_one_uses_every_class():
    index, remapped = draw([4, -1, 0], 9, 1.0)
    np.testing.assert_array_equal(index, np.arange(9))
    np.testing.assert_array_equal(remapped, [4, -1, 0])
