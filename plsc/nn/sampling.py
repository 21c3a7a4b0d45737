"""Class-centre sampling for Partial FC, as tensor operations on the head's device.

Contract: each rank keeps every class it owns that is a positive of the global
batch and fills up to `num_sample = max(int(ratio · num_local), #positives)`
with negatives drawn uniformly, without replacement, from its other classes;
the indices come out sorted. The draw is a pure function of (seed, step,
rank), so ranks need not communicate and a resumed run draws what the
uninterrupted run would have drawn.

Method. Give every local class an independent random key and take the
positives plus the non-positive classes of smallest key (insightface's
`rand` + `topk`), but without a key per class, so that the work is
O(num_sample), not O(num_local):

1. The classes whose key is below p form a Bernoulli(p) process. It is drawn
   directly as cumulative sums of geometric gaps, `floor(E / λ) + 1` with
   `E ~ Exp(1)`, `λ = −log(1 − p)`; p is chosen so that the process holds at
   least `num_sample` classes and covers the whole shard except with
   probability below 1e-20 (ten standard deviations).
2. The keys of those classes are i.i.d. and independent of the gaps: the
   fractional parts `E / λ − floor(E / λ)` (the exponential is memoryless).
   Any i.i.d. continuous keys order the candidates uniformly at random.
3. Positives get key −1 (always kept): in their slot if they are candidates,
   else in a spare slot that then holds their class. The `num_sample` smallest
   keys (top-k) are kept and their classes sorted.

Every shape is known before the draw when `int(ratio · num_local)` is at least
the global batch (then no positive count can exceed it), so a GPU step reads
nothing back to the host; below that, the number of positives is read once.
"""
import math

import numpy as np
import paddle
from paddle import _C_ops

__all__ = ["num_sampled", "sample_centres"]

_SIGMAS = 10.0  # margin of the Bernoulli process over the needed count, in standard deviations


def num_sampled(num_local, sample_ratio, num_positive):
    """`max(int(ratio · num_local), #positives)`: how many centres a step uses."""
    return max(int(sample_ratio * num_local), int(num_positive))


class _Seeded:
    """Draw from Paddle's generator seeded with `seed`, leaving its global state as it was."""

    def __init__(self, seed):
        self.seed = seed

    def __enter__(self):
        self.saved = [(None, paddle.get_rng_state())]
        if paddle.get_device() != "cpu":  # paddle.seed also reseeds the CPU generator
            self.saved.append(("cpu", paddle.get_rng_state("cpu")))
        paddle.seed(self.seed)

    def __exit__(self, *exc):
        for device, state in self.saved:
            paddle.set_rng_state(state, device=device)


_CONSTANTS = {}


def _constants(place, slots, spare, num_local):
    """Per device and shape, made once (so a step launches no `full`): the spare slots'
    indices, each slot's padding limit (a spare slot is always over it), float64 2 per slot,
    float64 −1 and 2 per spare slot, and int64 [-1]. Never written to."""
    key = (str(place), slots, spare, num_local)
    if key not in _CONSTANTS:
        if len(_CONSTANTS) >= 32:
            _CONSTANTS.clear()
        limit = np.full([slots + spare], -1, np.int64)
        limit[:slots] = num_local - 1
        arrays = (np.arange(slots, slots + spare, dtype=np.int64), limit,
                  np.full([slots + spare], 2.0), np.full([spare], -1.0), np.full([spare], 2.0),
                  np.full([1], -1, np.int64))
        _CONSTANTS[key] = tuple(paddle.to_tensor(a, place=place) for a in arrays)
    return _CONSTANTS[key]


def _put_along_(arr, index, values, reduce):
    """Paddle's put_along_axis_ along axis 0 (`index` in range, `values` of its shape), without
    `Tensor.put_along_axis_`'s broadcasts (and, with broadcast=False, its host read)."""
    return _C_ops.put_along_axis_(arr, index, values, 0, reduce, True)


def _draw_seed(seed, step, rank):
    """A 63-bit generator seed that depends on (seed, step, rank) only."""
    words = np.random.SeedSequence([int(seed), int(step), int(rank)]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def _candidates(num_local, count, spare):
    """A random set of classes holding `count` of them almost surely, plus `spare` free slots.

    Returns `(positions, keys, slots)`: `positions` 0-based, sorted (int64; entries
    from `num_local` on are padding), `keys` i.i.d. in [0, 1) (float64), both of length
    `slots + spare`; the last `spare` entries are the caller's to fill.
    """
    mean = count + _SIGMAS * math.sqrt(count) + _SIGMAS ** 2
    p = mean / num_local
    slots = int(math.ceil(mean + _SIGMAS * math.sqrt(mean) + _SIGMAS ** 2))
    if p >= 1.0 or slots >= num_local:  # every class is a candidate
        slots = num_local
        return (paddle.arange(slots + spare, dtype="int64"),
                paddle.rand([slots + spare], dtype="float64"), slots)
    scaled = paddle.empty([slots + spare], dtype="float64").exponential_(1.0)
    scaled = paddle.scale(scaled, -1.0 / math.log1p(-p))  # E / λ
    gaps = paddle.ceil(scaled)  # geometric(p)
    keys = gaps - scaled
    positions = paddle.scale(paddle.cumsum(gaps.astype("int64")), 1.0, -1.0)
    return positions, keys, slots


def sample_centres(local_target, num_local, sample_ratio, seed, step, rank):
    """Choose this step's class centres.

    Args:
        local_target: `[N]` int64 tensor, the label's index local to this rank or -1.
        num_local: classes this rank owns.
        sample_ratio: fraction of them to use, in (0, 1].
        seed, step, rank: what the draw depends on.

    Returns `(index, target)`: the sorted, unique local class indices to use
    (`[num_sample]` int64) and `local_target` remapped into positions of
    `index` (-1 kept for labels owned elsewhere).
    """
    if local_target.dtype != paddle.int64:
        local_target = local_target.astype("int64")
    n = local_target.shape[0]
    # Labels sorted (labels owned elsewhere, -1, first); `first` marks one copy of each owned one.
    labels = paddle.sort(local_target)
    place = labels.place
    minus_one = _constants(place, 0, 0, 0)[5]
    first = labels > paddle.concat([minus_one, labels[:-1]])
    base = int(sample_ratio * num_local)
    count = base if base >= n else num_sampled(num_local, sample_ratio, int(first.sum()))
    if count >= num_local:
        return paddle.arange(num_local, dtype="int64"), local_target

    with _Seeded(_draw_seed(seed, step, rank)):
        positions, keys, slots = _candidates(num_local, count, n)
    spare_at, limit, two, minus_ones, twos, _ = _constants(place, slots, n, num_local)
    keys = _C_ops.where(positions > limit, two, keys)  # padding and spare slots: key 2
    # Positives get key -1 (always kept): those among the candidates in their slot, the
    # others ("extras") in their spare slot, which then holds their label.
    at = paddle.clip(paddle.searchsorted(positions, labels), max=slots - 1)
    hit = paddle.logical_and(first, paddle.gather(positions, at) == labels)
    _put_along_(keys, _C_ops.where(hit, at, spare_at),
                _C_ops.where(first, minus_ones, twos), "amin")
    _put_along_(positions, spare_at, labels, "assign")
    # The `count` smallest keys (every -1 among them), their classes in sorted order.
    kept = paddle.topk(keys, count, largest=False, sorted=False)[1]
    index = paddle.sort(paddle.gather(positions, kept))
    # Position in `index` of each owned label; -1 (before every index) stays -1.
    return index, paddle.scale(paddle.searchsorted(index, local_target, right=True), 1.0, -1.0)
