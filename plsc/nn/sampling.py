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
3. Positives get key −1 (always kept); the `num_sample`-th smallest key splits
   kept from dropped; kept candidates and positives outside the process are
   merged into sorted order by counting (cumulative sums), not by sorting.

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


def _minus_one_or_two(flag):
    """float64 −1 where `flag`, 2 elsewhere (the keys of kept and of unused slots): two ops."""
    return paddle.scale(flag.astype("float64"), -3.0, 2.0)


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

    Returns `(positions, keys, slots)`: `positions` 1-based, sorted (int64; entries
    beyond `num_local` are padding), `keys` i.i.d. in [0, 1) (padding: 2, float64), both
    of length `slots + spare`; the last `spare` entries are the caller's to fill.
    """
    mean = count + _SIGMAS * math.sqrt(count) + _SIGMAS ** 2
    p = mean / num_local
    slots = int(math.ceil(mean + _SIGMAS * math.sqrt(mean) + _SIGMAS ** 2))
    if p >= 1.0 or slots >= num_local:  # every class is a candidate
        slots = num_local
        return (paddle.arange(1, slots + spare + 1, dtype="int64"),
                paddle.rand([slots + spare], dtype="float64"), slots)
    scaled = paddle.empty([slots + spare], dtype="float64").exponential_(1.0)
    scaled = paddle.scale(scaled, -1.0 / math.log1p(-p))  # E / λ
    gaps = paddle.ceil(scaled)  # geometric(p)
    keys = gaps - scaled
    positions = paddle.cumsum(gaps.astype("int64"))
    keys.masked_fill_(positions > num_local, 2.0)
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
    owned = local_target >= 0
    # Positives, 1-based and sorted; `first` marks one copy of each (owned labels only).
    labels = paddle.sort(paddle.where(owned, local_target, paddle.full([], num_local, "int64"))) + 1
    first = paddle.concat([paddle.ones([1], "bool"), labels[1:] != labels[:-1]]) \
        if n > 1 else paddle.ones([n], "bool")
    first = paddle.logical_and(first, labels <= num_local)
    base = int(sample_ratio * num_local)
    count = base if base >= n else num_sampled(num_local, sample_ratio, int(first.sum()))
    if count >= num_local:
        return paddle.arange(num_local, dtype="int64"), local_target

    with _Seeded(_draw_seed(seed, step, rank)):
        positions, keys, slots = _candidates(num_local, count, n)
    # Positives among the candidates get key -1; the others ("extras") take the spare
    # slots with key -1 and are merged in below.
    at = paddle.searchsorted(positions, labels)  # first slot >= label
    at_c = paddle.clip(at, max=slots - 1)
    hit = paddle.logical_and(first, paddle.gather(positions, at_c) == labels)
    _put_along_(keys, at_c, _minus_one_or_two(hit), "amin")
    extra = paddle.logical_and(first, paddle.logical_not(hit))
    keys[slots:] = _minus_one_or_two(extra)
    keep = keys <= paddle.kthvalue(keys, count)[0]
    keep_e = keep[slots:].astype("int64")
    keep[slots:] = False  # from here on `keep` marks kept candidates only
    keep_c = keep.astype("int64")
    # Sorted rank of each kept item = kept candidates before it + kept extras before it.
    zero, in_slots = paddle.zeros_like(keep_e), at < slots
    extras_at = _put_along_(paddle.zeros_like(keep_c), at_c,
                            paddle.where(in_slots, keep_e, zero), "add")
    rank_c = paddle.cumsum(keep_c + extras_at) - keep_c
    cands_before = paddle.gather(paddle.cumsum(keep_c), at_c) - paddle.where(
        in_slots, paddle.gather(keep_c, at_c), zero)
    rank_e = paddle.cumsum(keep_e) - keep_e + cands_before
    # Dropped items land in slot `count`, cut off below.
    index = paddle.zeros([count + 1], "int64")
    index.scatter_(rank_c.masked_fill_(paddle.logical_not(keep), count), positions)
    index.scatter_(rank_e.masked_fill_(keep_e == 0, count), labels)
    index = index[:count] - 1
    found = paddle.searchsorted(index, paddle.clip(local_target, min=0))
    return index, paddle.where(owned, found, local_target)  # -1 where not owned
