"""Class-centre sampling for Partial FC.

Each rank keeps every class it owns that is a positive of the global batch
and fills up to `num_sample` with negatives drawn uniformly, without
replacement, from its other classes. The draw is a pure function of
(seed, step, rank), so ranks need not communicate and a resumed run draws
what the uninterrupted run would have drawn.
"""
import numpy as np

__all__ = ["num_sampled", "sample_centres"]


def num_sampled(num_local, sample_ratio, num_positive):
    """`max(int(ratio · num_local), #positives)`: how many centres a step uses."""
    return max(int(sample_ratio * num_local), int(num_positive))


def sample_centres(local_target, num_local, sample_ratio, seed, step, rank):
    """Choose this step's class centres.

    Args:
        local_target: `[N]` int array, label index local to this rank or -1.
        num_local: classes this rank owns.
        sample_ratio: fraction of them to use, in (0, 1].
        seed, step, rank: what the draw depends on.

    Returns `(index, target)`: the sorted, unique local class indices to use
    (`[num_sample]` int64) and `local_target` remapped into positions of
    `index` (-1 kept for labels owned elsewhere).
    """
    local_target = np.asarray(local_target, dtype=np.int64)
    owned = local_target >= 0
    positives = np.unique(local_target[owned])
    num_sample = num_sampled(num_local, sample_ratio, len(positives))
    need = num_sample - len(positives)
    if need > 0:
        rng = np.random.default_rng([int(seed), int(step), int(rank)])
        # k-th class that is not a positive: k + #positives at or below it.
        picks = np.sort(rng.choice(num_local - len(positives), need, replace=False))
        shifted = positives - np.arange(len(positives))
        negatives = picks + np.searchsorted(shifted, picks, side="right")
        index = np.union1d(positives, negatives)
    else:
        index = positives
    target = np.full_like(local_target, -1)
    target[owned] = np.searchsorted(index, local_target[owned])
    return index.astype(np.int64), target
