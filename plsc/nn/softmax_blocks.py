"""The state of one `parallel_softmax_cross_entropy` call and the pieces every stage reads:
the `_Step` (the PyLayer's `ctx` holds only it), the blocks of classes the call walks
(`_Block`: one for the dense path, `chunk_size` classes each for the chunked path), the weight
rows as the GEMMs read them (`_BlockRows`, float32 a block or a slab at a time) and the slab
budgets of the weight gradient (`_SlabBudget`, fixed per call by `parallel_softmax`).

Package-internal: the names are shared by the head's modules (`softmax_stages`,
`subcenters`, `conflict_filter`, `grad_sinks`), not a public API.
"""
from typing import NamedTuple

import paddle
from paddle import _C_ops

from ..kernels.cpu_kernels import put_columns_, row_dot
from ..kernels.numerics import SLAB_BYTES, sqrt_exact
from .. import storage
from ..storage import read as _rows_f32

__all__ = ["put_along_"]

_NORM_EPS = 1e-12  # as paddle.nn.functional.normalize


class _SlabBudget(NamedTuple):
    """How much of a block's weight gradient (or float32 rows) one GEMM takes: on the CPU set
    a block up to `block_bytes` at once, else slabs of `slab` classes; on the device set up to
    `device_bytes` at once, else slabs of that many bytes."""
    block_bytes: int
    slab: int
    device_bytes: int


def _wgrad_plan(step, d):
    """(bytes a block's float32 weight gradient or rows may take at once, rows per slab beyond
    that) on the call's kernel set (`step.cpu`: the CPU set, else the device set), for rows
    of width `d`."""
    budget = step.budget
    if step.cpu:
        return budget.block_bytes, budget.slab
    return budget.device_bytes, max(1, budget.device_bytes // (4 * d))


def _inv_row_norms(step, weight):
    """1/|W_j| of every row, float32; a 16- or 8-bit weight is read a slab of rows at a time
    (`SLAB_BYTES` of float32 on the CPU set, the budget's `device_bytes` on the device set)."""
    if storage.is_float32(weight):
        return 1.0 / _row_norm(weight)
    slab_bytes = SLAB_BYTES if step.cpu else step.budget.device_bytes
    step_rows = max(1, slab_bytes // (4 * weight.shape[1]))
    if step_rows >= weight.shape[0]:
        return 1.0 / _row_norm(_rows_f32(weight))
    return paddle.concat([1.0 / _row_norm(_rows_f32(weight, i, i + step_rows))
                          for i in range(0, weight.shape[0], step_rows)])


def _row_norm(x):
    """L2 norm of each row, floored at _NORM_EPS, without an `x`-sized temporary."""
    return sqrt_exact(row_dot(x, x)).clip(min=_NORM_EPS)


class _BlockRows:
    """The float32 rows [lo, hi) of the weight, as the GEMMs read them: the block at once (a view
    of a float32 weight; a narrower block upcast whole while its float32 copy takes at most
    the budget's `block_bytes`, on the device set its `device_bytes`), else a slab of
    `slab` rows (device set: that budget's) at a time, read when asked for,
    so no float32 copy of a wide 16- or 8-bit block (the dense path's whole shard) exists."""

    def __init__(self, step, weight, lo, hi):
        self.weight, self.lo, self.hi = weight, lo, hi
        budget, self.slab = _wgrad_plan(step, weight.shape[1])
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
    per class), and each row's target column in it.

    Every row of the batch is addressed (rows whose target lies elsewhere write their own
    value back), so no shape depends on the labels and nothing is read back to the host."""

    def __init__(self, start, stop, local_target, sub_centers):
        self.start, self.stop = start, stop
        self.lo, self.hi = start * sub_centers, stop * sub_centers
        # Workspace names: a narrower block (a shard's last) gets a view of the kept buffer.
        self.buffer, self.centre_buffer, self.mask_buffer = "logits", "centres", "filtered"
        # inside: start <= target < stop, i.e. the column is unchanged by the clip
        offset = local_target - start if start else local_target
        col = paddle.clip(offset, 0, stop - start - 1)
        self.inside = col == offset
        self.col = col.unsqueeze(1)
        self.cos_t = self.pick = self.clamped = None
        self.inv_w = None  # 1/|W_j| of its rows while its logits exist (chunked path)

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
    the largest logit whose cosine is not above the filtering threshold), `budget` (a
    `_SlabBudget`). The forward's: `cpu` (the kernel set is the CPU set), `n`
    (rows of the batch), `weight`, `bias`, `blocks`, `need_x` and `need_w` (which inputs want a
    gradient); the batch as the logits read it: `features` (plain logits) or `x_norm`, `x_hat`,
    `x_scaled` = s·x̂ and, on the dense path, `inv_w` = 1/|W| (cosines); `row_max`, `sum_exp`
    and, on the dense path, `exp_logits` (the block's logits, then E = exp(logit − max)). While the backward
    runs: `d_w` (the weight gradient's array), `sink` (where its rows go otherwise), `d_b`."""

    __slots__ = ("margin", "group", "chunk_size", "workspace", "grad_into_weight", "row_update",
                 "sub_centers", "filter_above", "n", "weight", "bias", "blocks", "need_x",
                 "need_w", "features", "x_norm", "x_hat", "x_scaled", "inv_w", "row_max",
                 "sum_exp", "exp_logits", "d_w", "sink", "d_b", "cpu", "budget",
                 "__weakref__")  # a weak reference: the workspace's owner

    def __init__(self, margin, group, chunk_size, workspace, grad_into_weight, row_update,
                 sub_centers, filter_above, budget):
        self.margin, self.group, self.chunk_size = margin, group, chunk_size
        self.workspace, self.sub_centers, self.filter_above = workspace, sub_centers, filter_above
        self.grad_into_weight, self.row_update, self.budget = grad_into_weight, row_update, budget
        self.n = self.weight = self.bias = self.blocks = self.need_x = self.need_w = None
        self.features = self.x_norm = self.x_hat = self.x_scaled = self.inv_w = None
        self.row_max = self.sum_exp = self.exp_logits = None
        self.d_w = self.sink = self.d_b = None
        self.cpu = True


def _lend(step, name, shape, dtype="float32"):
    return step.workspace.lend(name, shape, step, dtype) if step.workspace is not None else None


def _give_back(step, *names):
    if step.workspace is not None:
        for name in names:
            step.workspace.give_back(name)
