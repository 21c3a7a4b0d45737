"""Entries of the logits that stay in the softmax's sum but pass no gradient: inter-class
filtering (arcface_torch's `interclass_filtering_threshold` for noisy data) sets the
non-target logits whose cosine exceeds the threshold to 0, and a margin's `cos_clip` (AdaFace)
clamps the non-target logits (`_filter_and_clamp_`); the backward zeroes both kinds of entry
in E = exp(logit − max) (`_zero_clamped_`). `filter_bound` turns the threshold into the
float32 logit bound the block is compared with.

The numpy passes look `as_numpy` up on `plsc.kernels.cpu_kernels` at each call, so that replacing it
there (as the device-set tests do, to prove no numpy kernel runs) reaches them too.
"""
import numpy as np
import paddle

from ..kernels import cpu_kernels
from ..kernels.cpu_kernels import applies, run_rows
from .softmax_blocks import _give_back, _lend

__all__ = ["filter_bound"]

_MASK_SLAB = 1 << 16  # entries of a slab of rows in the filter's and the mask's passes


def filter_bound(threshold, scale):
    """The largest float32 logit L whose cosine as the head computes it, fl32(L / fl32(s)) (the
    cosine the margin is given for a target), is not above fl32(threshold): so `L > bound` is
    exactly "cosine > threshold", compared in float32 as arcface_torch compares its float32
    cosines with the threshold, without dividing the block by s. (fl32(t·s) alone is not: for
    an s that is not a power of two, a logit an ulp from it can fall on either side.)"""
    t, s = np.float32(threshold), np.float32(scale)
    up, down = np.float32(np.inf), np.float32(-np.inf)
    bound = np.float32(np.float64(t) * np.float64(s))
    while bound / s > t:  # numpy float32 division: correctly rounded, as Paddle's
        bound = np.nextafter(bound, down)
    while np.nextafter(bound, up) / s <= t:
        bound = np.nextafter(bound, up)
    return float(bound)


def _filter_and_clamp_(step, block, logits, plain):
    """The non-target logits, in place: inter-class filtering (`step.filter_above`) sets those
    whose cosine is above the threshold to 0, then a margin's `cos_clip` clamps the rest to
    s·[−cos_clip, cos_clip]. `block.clamped` remembers which entries either changed: they stay
    in the softmax's sum but their gradient is zero (`_zero_clamped_`). The target entries are
    neither filtered nor clamped. Returns the entries at the target columns now (`plain` when
    neither applies: then nothing here runs)."""
    margin, above = step.margin, step.filter_above
    if margin.cos_clip is None and above is None:
        return plain
    block.put_(logits, paddle.zeros_like(plain), plain)  # 0: below any bound, not clamped
    frozen = _filter_(step, block, logits) if above is not None else None
    if margin.cos_clip is not None:
        bound = margin.scale * margin.cos_clip
        clamped = paddle.logical_or(logits > bound, logits < -bound)
        logits.clip_(-bound, bound)
        frozen = clamped if frozen is None else paddle.logical_or(frozen, clamped, out=frozen)
    block.clamped = frozen
    return block.take(logits)


def _filter_(step, block, logits):
    """Inter-class filtering, in place: the entries of the block's `logits` above
    `step.filter_above` (a float32 bound, so the float32 comparison is exactly "cosine >
    threshold", see `filter_bound`) become 0. Returns the `[N, width]` bool mask of them, in the
    workspace's buffer when it lends one. On the CPU one numpy pass over the block, a slab of
    rows at a time (the entries are multiplied by "not filtered": a masked write branches on a
    random mask and takes four times as long)."""
    mask = _lend(step, block.mask_buffer, logits.shape, "bool")
    if not (applies(logits) and logits.is_contiguous()):
        above = logits > step.filter_above
        logits.masked_fill_(above, 0.0)
        return above if mask is None else paddle.assign(above, mask)
    mask = paddle.empty(logits.shape, dtype=paddle.bool) if mask is None else mask
    a, m = cpu_kernels.as_numpy(logits), cpu_kernels.as_numpy(mask)
    bound = np.float32(step.filter_above)

    def rows(lo, hi):
        np.greater(a[lo:hi], bound, out=m[lo:hi])
        a[lo:hi] *= ~m[lo:hi]  # the filtered entries are finite and positive: exactly +0
    run_rows(rows, a.shape[0], max(1, _MASK_SLAB // a.shape[1]))
    return mask


def _zero_clamped_(step, block, exp_logits):
    """Zero where `block.clamped` (filtered or clamped entries: no gradient), then drop it."""
    mask = block.clamped
    if mask is None:
        return
    if applies(exp_logits, mask, dtypes=(paddle.float32, paddle.bool)) and exp_logits.is_contiguous():
        e, m = cpu_kernels.as_numpy(exp_logits), cpu_kernels.as_numpy(mask)

        def rows(lo, hi):
            e[lo:hi] *= ~m[lo:hi]  # E is finite and >= 0: exactly +0 where masked
        run_rows(rows, e.shape[0], max(1, _MASK_SLAB // e.shape[1]))
    else:
        exp_logits.masked_fill_(mask, 0.0)
    block.clamped = None
    _give_back(step, block.mask_buffer)
