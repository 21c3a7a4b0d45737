"""Memory-balanced softmax cross entropy over class-sharded logits.

Each rank holds the logits of its own classes for the gathered batch. Ranks
exchange only `[N]` vectors (row max, row sum of exponentials, target
log-probability); the backward is written by hand, so autograd never stores
the logits or the softmax.

Dense path: the `[N, C_local]` logits live in one buffer reused in place
(logits, then `exp(logit − max)`, then the gradient).

Chunked path (`chunk_size`): the classes are walked in blocks of `chunk_size`
rows of the weight. The forward keeps a running row max and sum of
exponentials per block (as flash attention does) and never holds more than
one `[N, chunk_size]` block; the backward recomputes each block's logits,
forms its gradient, accumulates the embedding gradient and writes that
block's weight gradient. The collectives are the dense path's: one MAX, one
SUM, the loss SUM (and the embedding-gradient reduce-scatter outside).

Storage is not compute: the weight (and bias) may be stored in bfloat16 or float16, or the
weight in 8 bits a value with a scale a row (`plsc.quantized.Int8Rows`, which is no Paddle
tensor: its gradient goes to `row_update`). Each block of rows is read as float32 for its GEMMs
(`rows_f32`, the one place this happens; Paddle 3.3 has no 16-bit matmul on CPU) and every
statistic (row max, sum of exponentials, target logit, log-probability) is float32.

Sub-centres (K centres a class, class-major rows): a block's GEMM gives the `[N, K·width]`
cosines of its centres; `_class_max` reduces them to the class logits and remembers the winning
centre, `_to_centres` sends each class's gradient back to it. Margins with a `cos_clip`
(AdaFace) clamp the non-target logits, and inter-class filtering (arcface_torch's
`interclass_filtering_threshold`) sets the non-target logits whose cosine exceeds the
threshold to 0 (`_filter_and_clamp_`); those entries are in the softmax but get no gradient
(`_zero_clamped_`).

The backward works a block (for wide blocks a slab of `_WGRAD_SLAB` classes, copied out of
the block once) at a time: the embedding gradient is summed over them, and the weight gradient
goes where the caller wants it, the same GEMM shapes either way: straight from the GEMM into
the array the backward returns, or to a sink that writes it over the weight (Partial FC's
scratch rows) or gives it to `row_update`, which applies the optimizer to those rows at once,
so that no weight-gradient array exists (at most a 64 MiB block of it).

The element-wise passes over the logits (column scaling, row max, exp, row sums) and the row
dot products go through `plsc.cpu_kernels` (numpy on the tensors' memory on the CPU, Paddle's
ops elsewhere).

Code layout: the PyLayer is called with keywords, and its `ctx` holds one `_Step`, the call's
state with named fields. The forward is a series of stages, gather → logits → max → sum →
target → loss (`_gather` … `_loss`). The backward goes back through them: loss, then a block
at a time sum and max → target → logits, then gather (`_loss_grad` … `_gather_grad`).
"""
import numpy as np
import paddle
from paddle import _C_ops
from paddle.autograd import PyLayer

from ..cpu_kernels import (DEVICE_SLAB_BYTES, applies, as_numpy, copy_columns, cpu_set,
                           exp_shifted_, put_columns_,
                           remove_row_components_, row_dot, run_rows, scale_columns_)
from ..cpu_kernels import row_max as row_max_of
from ..distributed import all_reduce_
from ..numerics import SLAB_BYTES, cast_nearest, sqrt_exact
from .. import storage
from ..storage import read as _rows_f32

__all__ = ["parallel_softmax_cross_entropy"]

_NORM_EPS = 1e-12  # as paddle.nn.functional.normalize
_WGRAD_SLAB = 4096  # classes per weight-gradient GEMM of a wide block (and per fused update)
_WGRAD_BLOCK_BYTES = 64 << 20  # a block's weight gradient up to this size is one GEMM
# The device set's budget for the same (and for a narrow block's float32 rows): one slab of
# `DEVICE_SLAB_BYTES` (256 MiB), so a Partial FC step's sampled rows are one slab.
_DEVICE_WGRAD_BYTES = DEVICE_SLAB_BYTES
_MASK_SLAB = 1 << 16  # entries of a slab of rows in the filter's and the mask's passes


def _wgrad_plan(cpu, d):
    """(bytes a block's float32 weight gradient or rows may take at once, rows a slab beyond
    that) on the CPU set (`cpu`) or the device set, for rows of width `d`."""
    if cpu:
        return _WGRAD_BLOCK_BYTES, _WGRAD_SLAB
    return _DEVICE_WGRAD_BYTES, max(1, _DEVICE_WGRAD_BYTES // (4 * d))


def _inv_row_norms(weight, cpu=True):
    """1/|W_j| of every row, float32; a 16- or 8-bit weight is read a slab of rows at a time
    (`SLAB_BYTES` of float32 on the CPU set, `_DEVICE_WGRAD_BYTES` on the device set)."""
    if storage.is_float32(weight):
        return 1.0 / _row_norm(weight)
    step = max(1, (SLAB_BYTES if cpu else _DEVICE_WGRAD_BYTES) // (4 * weight.shape[1]))
    if step >= weight.shape[0]:
        return 1.0 / _row_norm(_rows_f32(weight))
    return paddle.concat([1.0 / _row_norm(_rows_f32(weight, i, i + step))
                          for i in range(0, weight.shape[0], step)])


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


def _row_norm(x):
    """L2 norm of each row, floored at _NORM_EPS, without an `x`-sized temporary."""
    return sqrt_exact(row_dot(x, x)).clip(min=_NORM_EPS)


class _BlockRows:
    """The float32 rows [lo, hi) of the weight, as the GEMMs read them: the block at once (a view
    of a float32 weight; a narrower block upcast whole while its float32 copy takes at most
    `_WGRAD_BLOCK_BYTES`, on the device set `_DEVICE_WGRAD_BYTES`), else a slab of
    `_WGRAD_SLAB` rows (device set: that budget's) at a time, read when asked for,
    so no float32 copy of a wide 16- or 8-bit block (the dense path's whole shard) exists."""

    def __init__(self, step, weight, lo, hi):
        self.weight, self.lo, self.hi = weight, lo, hi
        budget, self.slab = _wgrad_plan(step.cpu, weight.shape[1])
        narrow = not storage.is_float32(weight)
        self.whole = not narrow or (hi - lo) * weight.shape[1] * 4 <= budget
        whole_shard = (lo, hi) == (0, weight.shape[0])  # no slice op
        self.rows = None if not self.whole else \
            _rows_f32(weight) if whole_shard else _rows_f32(weight, lo, hi)

    def slabs(self):
        """(a, b) bounds of the slabs the rows are read in, relative to `lo`."""
        step = self.hi - self.lo if self.whole else self.slab
        return [(a, min(a + step, self.hi - self.lo)) for a in range(0, self.hi - self.lo, step)]

    def get(self, a, b):
        """Rows [lo + a, lo + b) as float32."""
        if self.rows is not None:
            return self.rows if (a, b) == (0, self.hi - self.lo) else self.rows[a:b]
        return _rows_f32(self.weight, self.lo + a, self.lo + b)


def _rows(t, lo, hi):
    """t[lo:hi], or `t` itself when that is all of it (no slice op)."""
    return t if (lo, hi) == (0, t.shape[0]) else t[lo:hi]


def put_along_(buf, index, values, axis):
    """buf[index] = values along `axis` in place (`index` in range, same rank as `buf`):
    Paddle's op without `Tensor.put_along_axis_`'s bounds check, which reads
    `(index < size).all()` back to the host (a device sync) on every call."""
    return _C_ops.put_along_axis_(buf, index, values, axis, "assign", True)


def _matmul_rows(x, w, out):
    """x·wᵀ (`w`: a `_BlockRows`) into `out` when given ([N, rows]); a wide narrow block a slab
    of rows at a time, each slab's columns copied into the output."""
    if w.whole:
        return paddle.matmul(x, w.rows, transpose_y=True, out=out)
    if out is None:
        out = paddle.empty([x.shape[0], w.hi - w.lo], dtype="float32")
    for a, b in w.slabs():
        put_columns_(out, a, paddle.matmul(x, w.get(a, b), transpose_y=True))
    return out


class _Block:
    """The classes [start, stop) of this rank's shard (weight rows [lo, hi): `sub_centers` rows
    a class), and each row's target column in it.

    Every row of the batch is addressed (rows whose target lies elsewhere write their own
    value back), so no shape depends on the labels and nothing is read back to the host."""

    def __init__(self, start, stop, local_target, sub_centers):
        self.start, self.stop = start, stop
        self.lo, self.hi = start * sub_centers, stop * sub_centers
        self.buffer = f"logits[{stop - start}]"  # workspace names: one buffer per block width
        self.centre_buffer = f"centres[{self.hi - self.lo}]"
        self.mask_buffer = f"filtered[{stop - start}]"
        # inside: start <= target < stop, i.e. the column is unchanged by the clip
        offset = local_target - start if start else local_target
        col = paddle.clip(offset, 0, stop - start - 1)
        self.inside = col == offset
        self.col = col.unsqueeze(1)
        self.cos_t = self.pick = self.clamped = None

    def take(self, buf):
        """`[N]` entries of `buf` at each row's target column."""
        return paddle.take_along_axis(buf, self.col, 1, broadcast=False).squeeze(1)

    def put_(self, buf, value, old):
        """Write `value` at the target entries of the rows inside this block, in place."""
        put_along_(buf, self.col, paddle.where(self.inside, value, old).unsqueeze(1), 1)


def _blocks(local_target, num_classes, chunk_size, sub_centers):
    step = num_classes if not chunk_size else int(chunk_size)
    return [_Block(s, min(s + step, num_classes), local_target, sub_centers)
            for s in range(0, num_classes, step)]


class _Step:
    """The state of one call, from its forward to its backward (the PyLayer's `ctx` holds only
    this). The options are given; the forward's stages fill in the rest, the backward reads it.

    Options: `margin` (the gathered batch's after `_gather`), `group`, `chunk_size`,
    `workspace`, `grad_into_weight`, `row_update`, `sub_centers`, `filter_above` (None, or
    the largest logit whose cosine is not above the filtering threshold). The forward's: `n`
    (rows of the batch), `weight`, `bias`, `blocks`, `need_x` and `need_w` (which inputs want a
    gradient); the batch as the logits read it: `features` (plain logits) or `x_norm`, `x_hat`,
    `x_scaled` = s·x̂ and `inv_w` = 1/|W| (cosines); `row_max`, `sum_exp` and, on the dense
    path, `exp_logits` (the block's logits, then E = exp(logit − max)). While the backward
    runs: `d_w` (the weight gradient's array), `sink` (where its rows go otherwise), `d_b`."""

    __slots__ = ("margin", "group", "chunk_size", "workspace", "grad_into_weight", "row_update",
                 "sub_centers", "filter_above", "n", "weight", "bias", "blocks", "need_x",
                 "need_w", "features", "x_norm", "x_hat", "x_scaled", "inv_w", "row_max",
                 "sum_exp", "exp_logits", "d_w", "sink", "d_b", "cpu",
                 "__weakref__")  # a weak reference: the workspace's owner

    def __init__(self, margin, group, chunk_size, workspace, grad_into_weight, row_update,
                 sub_centers, filter_above=None):
        self.margin, self.group, self.chunk_size = margin, group, chunk_size
        self.workspace, self.sub_centers, self.filter_above = workspace, sub_centers, filter_above
        self.grad_into_weight, self.row_update = grad_into_weight, row_update
        self.n = self.weight = self.bias = self.blocks = self.need_x = self.need_w = None
        self.features = self.x_norm = self.x_hat = self.x_scaled = self.inv_w = None
        self.row_max = self.sum_exp = self.exp_logits = None
        self.d_w = self.sink = self.d_b = None
        self.cpu = True


def _lend(step, name, shape, dtype="float32"):
    return step.workspace.lend(name, shape, step, dtype) if step.workspace is not None else None


def _class_max(step, block, cos):
    """Sub-centres: each class's logit is the largest of its K centres' (`cos`: `[N, K·width]`,
    class-major); `block.pick` keeps which centre (the first of equal ones) for the backward.
    With one centre a class, `cos` itself."""
    k = step.sub_centers
    if k == 1:
        return cos
    per_class = cos.reshape([step.n, block.stop - block.start, k])
    block.pick = paddle.argmax(per_class, axis=2, keepdim=True, dtype="int32")
    out = paddle.take_along_axis(per_class, block.pick, 2, broadcast=False).squeeze(2)
    _give_back(step, block.centre_buffer)
    return out


def _to_centres(step, block, buf):
    """The gradient `buf` of the class logits as that of the centres' (`[N, K·width]`): each
    class's entry goes to the centre that won the max, zero to the others."""
    if step.sub_centers == 1:
        return buf
    width, k = block.stop - block.start, step.sub_centers
    out = _lend(step, block.centre_buffer, [step.n, width * k])
    out = paddle.zeros([step.n, width * k], "float32") if out is None else out.zero_()
    put_along_(out.reshape([step.n, width, k]), block.pick.astype("int64"), buf.unsqueeze(2), 2)
    block.pick = None
    return out


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
    a, m, bound = as_numpy(logits), as_numpy(mask), np.float32(step.filter_above)

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
        e, m = as_numpy(exp_logits), as_numpy(mask)

        def rows(lo, hi):
            e[lo:hi] *= ~m[lo:hi]  # E is finite and >= 0: exactly +0 where masked
        run_rows(rows, e.shape[0], max(1, _MASK_SLAB // e.shape[1]))
    else:
        exp_logits.masked_fill_(mask, 0.0)
    block.clamped = None
    _give_back(step, block.mask_buffer)


def _block_logits(step, block, w, bias):
    """Logits of one block (`w`: its weight rows, a `_BlockRows`; margin applied to its targets), written
    into the workspace's buffer for blocks of this width when it lends one; returns (logits,
    `[N]` target logits, meaningful for the rows whose target is inside the block)."""
    margin = step.margin
    if margin.normalized:
        # cos = x̂·Ŵᵀ without an `Ŵ` copy: x̂ is pre-scaled by s, column j divided by |W_j|.
        name = block.buffer if step.sub_centers == 1 else block.centre_buffer
        cos = _matmul_rows(step.x_scaled, w, _lend(step, name, [step.n, block.hi - block.lo]))
        scale_columns_(cos, _rows(step.inv_w, block.lo, block.hi))
        logits = _class_max(step, block, cos)
        plain = block.take(logits)
        block.cos_t = plain / margin.scale
        target_logit = margin.target_logit(block.cos_t)
        block.put_(logits, target_logit, _filter_and_clamp_(step, block, logits, plain))
    else:
        logits = _matmul_rows(step.features, w,
                              _lend(step, block.buffer, [step.n, block.stop - block.start]))
        if bias is not None:
            logits.add_(_rows_f32(bias, block.start, block.stop))
        target_logit = block.take(logits)
    return logits, target_logit


# The forward's stages, in order: gather → logits → max → sum → target → loss.

def _gather(step, features, weight, bias, local_target):
    """Gather: the gathered batch as the logits read it (cosines: |x|, x̂, s·x̂, 1/|W| and the
    margin for this batch), the blocks of classes, which inputs want a gradient."""
    step.n, step.weight, step.bias = features.shape[0], weight, bias
    step.cpu = cpu_set(features)  # the kernel set of this call (slab budgets)
    if step.margin.normalized:
        step.x_norm = _row_norm(features)
        step.margin = step.margin.for_batch(step.x_norm)
        step.x_hat = features / step.x_norm.unsqueeze(1)
        step.x_scaled = step.x_hat * step.margin.scale
        step.inv_w = _inv_row_norms(weight, step.cpu)
    else:
        step.features = features
    step.blocks = _blocks(local_target, weight.shape[0] // step.sub_centers, step.chunk_size,
                          step.sub_centers)
    step.need_x, step.need_w = not features.stop_gradient, not weight.stop_gradient
    if step.need_w and not storage.has_autograd(weight) and step.row_update is None:
        raise ValueError("an 8-bit weight (Int8Rows) has no autograd gradient: give row_update, "
                         "which receives its gradient rows")


def _logits(step, dtype):
    """Logits, this rank's: dense, the one block's (kept in `step.exp_logits` for the backward)
    and their row max; chunked, each block's folded into a running row max and sum of
    exponentials (as flash attention does), then dropped. Returns (`[N]` target logits, local
    row max, local sum of exp(logit − that max): None on the dense path, whose sum waits for
    the global max)."""
    blocks, weight, bias = step.blocks, step.weight, step.bias
    if len(blocks) == 1:
        w = _BlockRows(step, weight, 0, weight.shape[0])
        logits, target_logit = _block_logits(step, blocks[0], w, bias)
        step.exp_logits = logits
        return target_logit, row_max_of(logits), None
    run_max = paddle.full([step.n], float("-inf"), dtype=dtype)
    run_sum = paddle.zeros([step.n], dtype=dtype)
    target_logit = paddle.zeros([step.n], dtype=dtype)
    for block in blocks:
        w = _BlockRows(step, weight, block.lo, block.hi)
        logits, t = _block_logits(step, block, w, bias)
        block.pick = block.clamped = None  # the backward finds them again
        target_logit = paddle.where(block.inside, t, target_logit)
        new_max, block_sum = exp_shifted_(logits, run_max, running=True)
        run_sum = run_sum * paddle.exp(run_max - new_max) + block_sum
        run_max = new_max
        del logits, w
        _give_back(step, block.buffer, block.centre_buffer, block.mask_buffer)
    return target_logit, run_max, run_sum


def _max(step, local_max):
    """Max: the row max over every rank's classes (one MAX all-reduce; in a copy of the chunked
    path's running max, which `_sum` still reads)."""
    dense = step.exp_logits is not None
    step.row_max = all_reduce_(local_max if dense else local_max.clone(), "max", step.group)


def _sum(step, local_max, local_sum):
    """Sum: the row sum of exp(logit − max) over every rank's classes (one SUM all-reduce). On the
    dense path the kept logits become E = exp(logit − max) in place, zero where clamped (in the
    sum, but no gradient)."""
    if step.exp_logits is not None:
        step.sum_exp = all_reduce_(exp_shifted_(step.exp_logits, step.row_max)[1], "sum",
                                   step.group)
        _zero_clamped_(step, step.blocks[0], step.exp_logits)
    else:
        step.sum_exp = all_reduce_(local_sum * paddle.exp(local_max - step.row_max), "sum",
                                   step.group)


def _target(step, target_logit, local_target):
    """Target: log p[target] on the rank that owns the label, 0 elsewhere."""
    logp = target_logit - step.row_max - paddle.log(step.sum_exp)
    owned = step.blocks[0].inside if len(step.blocks) == 1 else local_target >= 0
    return paddle.where(owned, logp, paddle.zeros_like(logp))


def _loss(step, target_logp):
    """Loss: −log p[target], summed over ranks (one SUM all-reduce), so the same on every rank.
    The dense buffer goes back to the workspace at once when no backward will come."""
    all_reduce_(target_logp, "sum", step.group)
    if step.exp_logits is not None and not (step.need_x or step.need_w):
        step.exp_logits = None
        _give_back(step, step.blocks[0].buffer, step.blocks[0].centre_buffer)
    return -target_logp


# The backward's: loss → (a block at a time: sum and max → target → logits) → gather.

def _loss_grad(step, grad):
    """Loss, reversed: with S the row sum of E = exp(logit − max), dL/dlogit = r·(E − S·onehot)
    with r = g/S; returns r (`[N, 1]`)."""
    return (grad / step.sum_exp).unsqueeze(1)


def _open_grads(step, n):
    """Where the gradients go: the embedding's into a zeroed `[N, d]` array, the bias's into
    `step.d_b`, the weight's into an array the backward returns (`step.d_w`), over Partial FC's
    scratch rows or into the optimizer's update (`step.sink`). Returns (d_x, d_w returned)."""
    weight, bias = step.weight, step.bias
    d_x = paddle.zeros([n, weight.shape[1]], dtype="float32") if step.need_x else None
    step.d_b = paddle.empty(bias.shape, dtype="float32") if bias is not None else None
    step.d_w = step.sink = d_w = None
    if step.row_update is not None:  # no weight gradient array at all
        step.sink = step.row_update
    elif step.need_w and step.grad_into_weight:
        step.sink, d_w = _over_weight(weight), weight
    elif step.need_w and weight.dtype != paddle.float32:  # a 16-bit gradient, slab by slab
        d_w = paddle.empty(weight.shape, dtype=weight.dtype)
        step.sink = _into_narrow(d_w)
    elif step.need_w:
        step.d_w = d_w = paddle.empty(weight.shape, dtype="float32")
    return d_x, d_w


def _sum_grad(step, block, w):
    """Sum and max, reversed: the block's E = exp(logit − max) (the max has no gradient of its
    own), the forward's (dense) or from its logits recomputed (chunked)."""
    if step.exp_logits is not None:
        buf, step.exp_logits = step.exp_logits, None
        return buf
    buf, _ = _block_logits(step, block, w, step.bias)
    exp_shifted_(buf, step.row_max, want_sum=False)
    _zero_clamped_(step, block, buf)
    return buf


def _target_grad(step, block, buf):
    """Target, reversed: E − S at the target entries of `buf`, in place (for cosines times the
    margin's derivative over s), so `buf` is dL/dlogit / r."""
    margin = step.margin
    old = block.take(buf)
    target = old - step.sum_exp
    if margin.normalized:
        target = target * margin.target_grad(block.cos_t) / margin.scale
    block.put_(buf, target, old)


def _logits_grad(step, block, buf, w, row_scale, d_x):
    """Logits, reversed: from the block's dL/dlogit / r in `buf` (`w`: its `_BlockRows`), adds
    the embedding part to `d_x` and produces the block's weight (and bias) gradient rows. r is
    applied to the small GEMM operands and the output, so the GEMMs are the only passes over
    `buf` (and, for a wide block, the one pass that copies each column slab for them,
    `_slabs`)."""
    margin = step.margin
    if margin.normalized:
        # dL/dcos = s·r·buf; cos = x̂·Ŵᵀ with Ŵ = W·diag(1/|W|): column j of buf is divided
        # by |W_j| before both GEMMs.
        buf = _to_centres(step, block, buf)
        inv_w = _rows(step.inv_w, block.lo, block.hi)
        scale = row_scale * margin.scale
        rhs = step.x_hat * scale
    else:
        inv_w, scale = None, row_scale
        rhs = step.features * row_scale
    if step.d_b is not None:  # the bias (plain softmax) has one gradient per class
        paddle.matmul(buf, row_scale.reshape([-1]), transpose_x=True,
                      out=step.d_b[block.start:block.stop])
    d_x_block = None
    for lo, hi, part in _slabs(step, buf, inv_w, rhs.shape[1]):
        rows = w.get(lo, hi)
        if d_x is not None:
            prod = paddle.matmul(part, rows)
            d_x_block = prod if d_x_block is None else d_x_block.add_(prod)
        if step.need_w:
            _weight_grad_rows(step, block.lo + lo, block.lo + hi, part, rows,
                              None if inv_w is None else inv_w[lo:hi], rhs)
    if d_x_block is not None:
        d_x.add_(d_x_block * scale)


def _slabs(step, buf, inv_w, d):
    """(lo, hi, columns [lo, hi) of `buf` times `inv_w[lo:hi]`) over the block: the whole
    block, scaled in place, when its weight gradient takes at most `_WGRAD_BLOCK_BYTES`
    (64 MiB); else slabs of `_WGRAD_SLAB` columns, each scaled into one contiguous scratch
    (the GEMMs need contiguous operands, and a column slab of `buf` is a strided view), so the
    scaling and the copy are one pass. Both paths of the weight gradient (into an array, or
    into `step.sink`) see the same slabs, so they agree bit for bit whatever the BLAS kernel
    (MKL's AVX2 kernels round a row differently for different row counts)."""
    width = buf.shape[1]
    budget, slab = _wgrad_plan(step.cpu, d)
    if width * d * 4 <= budget:
        yield 0, width, buf if inv_w is None else scale_columns_(buf, inv_w)
        return
    scratch = None  # one slab's copy, reused while the slab width stays the same
    for lo in range(0, width, slab):
        hi = min(lo + slab, width)
        scratch = copy_columns(buf, lo, hi, None if inv_w is None else inv_w[lo:hi],
                               out=scratch)
        yield lo, hi, scratch


def _weight_grad_rows(step, lo, hi, part, w, inv_w, rhs):
    """Weight rows [lo, hi)'s gradient from their slab `part` of the logits' gradient (its
    columns already divided by |W_j| for normalised logits): P = partᵀ·rhs, and for normalised
    logits the correction dW_j = P_j − W_j (W_j·P_j) / |W_j|² (P is dL/dŴ / |W|). Into
    `step.d_w`'s rows the GEMM writes in place; to `step.sink` the rows are handed over."""
    out = step.d_w[lo:hi] if step.d_w is not None else None
    g_w = paddle.matmul(part, rhs, transpose_x=True, out=out)
    if inv_w is not None:
        remove_row_components_(g_w, w, inv_w)
    if step.d_w is None:
        step.sink(lo, hi, g_w, None)


def _close_grads(step):
    """The bias gradient to return (None when `row_update` took it, at once); the backward's
    arrays and sink are dropped from the step."""
    d_b = step.d_b
    if step.row_update is not None and d_b is not None:  # the bias's update, at once
        step.row_update(0, d_b.shape[0], None, d_b)
        d_b = None
    step.d_w = step.d_b = step.sink = None
    return d_b


def _gather_grad(step, d_x):
    """Gather, reversed: for cosines, the embedding gradient through x̂ = x/|x|."""
    if d_x is not None and step.margin.normalized:
        x_hat = step.x_hat
        d_x = (d_x - x_hat * row_dot(x_hat, d_x).unsqueeze(1)) / step.x_norm.unsqueeze(1)
    return d_x


def _over_weight(weight):
    """A sink writing gradient rows over the rows of `weight` (a scratch copy)."""
    def write(lo, hi, g_w, g_b):
        weight[lo:hi] = g_w
    return write


def _into_narrow(d_w):
    """A sink writing gradient rows into `d_w` (16 bits), rounded to nearest as Paddle would
    round a float32 gradient returned for a 16-bit input, a slab at a time: no float32
    `[C_local, d]` gradient exists."""
    def write(lo, hi, g_w, g_b):
        d_w[lo:hi] = cast_nearest(g_w, d_w.dtype)
    return write


def _give_back(step, *names):
    if step.workspace is not None:
        for name in names:
            step.workspace.give_back(name)


class _ParallelSoftmaxCE(PyLayer):
    """Per-sample loss of the gathered batch; see `parallel_softmax_cross_entropy`. Called with
    keywords: the tensors, and `step`, a new `_Step` holding the options, which `ctx` keeps."""

    @staticmethod
    def forward(ctx, *, features, weight, bias, local_target, step):
        ctx.step = step
        _gather(step, features, weight, bias, local_target)
        target_logit, local_max, local_sum = _logits(step, features.dtype)
        _max(step, local_max)
        _sum(step, local_max, local_sum)
        return _loss(step, _target(step, target_logit, local_target))

    @staticmethod
    def backward(ctx, grad):
        step = ctx.step
        row_scale = _loss_grad(step, grad)
        d_x, d_w = _open_grads(step, grad.shape[0])
        for block in step.blocks:  # the chunked path recomputes the logits it dropped
            w = _BlockRows(step, step.weight, block.lo, block.hi)
            buf = _sum_grad(step, block, w)
            _target_grad(step, block, buf)
            _logits_grad(step, block, buf, w, row_scale, d_x)
            del buf, w
            _give_back(step, block.buffer, block.centre_buffer)
        d_b = _close_grads(step)
        d_x = _gather_grad(step, d_x)
        # One gradient per tensor passed to `apply`, in the order they were passed there (an
        # 8-bit weight is no tensor).
        grads = (d_x,) + ((d_w,) if storage.has_autograd(step.weight) else ())
        return grads + ((d_b,) if step.bias is not None else ()) + (None,)


def parallel_softmax_cross_entropy(features, weight, bias, local_target, margin, group=None,
                                   chunk_size=None, workspace=None, grad_into_weight=False,
                                   row_update=None, sub_centers=1,
                                   interclass_filtering_threshold=0.0):
    """Per-sample softmax cross entropy with classes split across ranks.

    Args:
        features: `[N, d]` float32, the gathered global batch (same on every rank).
        weight: `[C_local·sub_centers, d]`, this rank's class centres (float32, bfloat16 or
            float16, or a `plsc.quantized.Int8Rows` with `row_update`); with sub-centres, class
            j's are rows j·K … j·K + K − 1.
        bias: `[C_local]` or None (used only by the plain `Softmax` margin).
        local_target: `[N]` int64, the label's index into `weight` where this
            rank owns it, -1 elsewhere (see `ClassPartition.shard_labels`).
        margin: a `plsc.loss.Margin` (a batch-dependent one, AdaFace, is given the gathered
            feature norms through `margin.for_batch`).
        group: process group of the class shards (default: the world).
        chunk_size: None for the dense path, else classes per block of the
            chunked path (memory `[N, chunk_size]` instead of `[N, C_local]`).
        workspace: a `plsc.nn.Workspace` whose buffers the logits are written into
            (kept from step to step), or None to allocate them each call.
        grad_into_weight: `weight` is a scratch copy (Partial FC's gathered rows): the
            backward writes the weight gradient over it, slab by slab as each slab's rows
            are last used, and returns it as the gradient, so no second `[C_local, d]`
            array exists. Its values are gone after the backward.
        row_update: None, or `row_update(lo, hi, weight_grad, bias_grad)`, called in the
            backward with the float32 gradient of rows [lo, hi) of `weight` (and `bias`)
            as soon as it exists and after those rows were last read: it applies the
            optimizer to them (see `plsc.optim.SparseRowOptimizer.fused_update`). No
            weight or bias gradient is returned then.
        sub_centers: K centres a class (normalised margins only): a class's cosine is the
            largest of its K centres', and its gradient goes to that centre (the first of
            equal ones; equal as computed: the GEMM may round two identical centres' cosines
            an ulp apart, depending on their position in the block). `chunk_size` counts classes, so a block holds K·chunk_size cosines.
        interclass_filtering_threshold: inter-class filtering (arcface_torch's noisy-data
            recipe; normalised margins only): 0 is off; above 0, every non-target entry whose
            cosine (float32; with sub-centres the class's, the largest of its K) is above it
            gets logit 0 before the margin and the scale: it still adds exp(0 − max) to the
            softmax's sum, but no gradient. Target entries are never filtered.

    Returns `[N]` losses, identical on every rank. Gradients flow to `features`,
    `weight` and `bias`; the gradient of `features` is this rank's share and
    must be summed over ranks (the backward of an all-gather does that). A 16-bit
    weight's returned gradient is in its dtype (float32 results rounded to nearest, a slab at
    a time).
    """
    if local_target.dtype != paddle.int64:
        local_target = local_target.astype("int64")
    sub_centers = int(sub_centers)
    if sub_centers < 1 or weight.shape[0] % sub_centers:
        raise ValueError(f"sub_centers must be a positive divisor of the weight's {weight.shape[0]} "
                         f"rows, got {sub_centers}")
    if sub_centers > 1 and not margin.normalized:
        raise ValueError(f"sub-centres need a normalised margin (a cosine per centre), not {margin}")
    if chunk_size is not None and int(chunk_size) * sub_centers >= weight.shape[0]:
        chunk_size = None
    filter_above = None
    if interclass_filtering_threshold > 0:  # as arcface_torch: above 0 is on
        if not margin.normalized:
            raise ValueError(f"interclass_filtering_threshold={interclass_filtering_threshold} "
                             f"needs a normalised margin (it filters cosines), not {margin}")
        filter_above = filter_bound(interclass_filtering_threshold, margin.scale)
    step = _Step(margin, group, chunk_size, workspace, grad_into_weight, row_update, sub_centers,
                 filter_above)
    # Paddle matches the backward's gradients to the tensors in the order they are passed here
    # (features, weight, bias, local_target), keywords included.
    return _ParallelSoftmaxCE.apply(features=features, weight=weight, bias=bias,
                                    local_target=local_target, step=step)
