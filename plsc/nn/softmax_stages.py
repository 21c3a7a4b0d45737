"""The stages of the collective softmax cross entropy, dense and chunked alike.

The forward is a series of stages, gather → logits → max → sum → target → loss (`_gather` …
`_loss`). On the dense path the one block's `[N, C_local]` logits live in one buffer reused in
place (logits, then E = exp(logit − max), then the gradient); on the chunked path each block
of `chunk_size` classes is folded into a running row max and sum of exponentials (as flash
attention does) and dropped. Ranks exchange only `[N]` vectors: one MAX, one SUM, the loss SUM.

The backward goes back through them: loss, then a block at a time sum and max → target →
logits (the chunked path recomputes the block's logits), then gather (`_loss_grad` …
`_gather_grad`). Where the weight gradient goes is `grad_sinks`'; the sub-centres' max and the
filtered or clamped entries are `subcenters`' and `conflict_filter`'s.
"""
import paddle

from ..kernels.cpu_kernels import cpu_set, exp_shifted_, row_dot, scale_columns_
from ..kernels.cpu_kernels import row_max as row_max_of
from ..distributed import all_reduce_
from .. import storage
from ..storage import read as _rows_f32
from .conflict_filter import _filter_and_clamp_, _zero_clamped_
from .grad_sinks import _slabs, _weight_grad_rows
from .softmax_blocks import (_BlockRows, _blocks, _give_back, _inv_row_norms, _lend,
                             _matmul_rows, _row_norm, _rows)
from .subcenters import _class_max, _to_centres


def _block_logits(step, block, w, bias):
    """Logits of one block (`w`: its weight rows, a `_BlockRows`; margin applied to its targets), written
    into the workspace's buffer for blocks of this width when it lends one; returns (logits,
    `[N]` target logits, meaningful for the rows whose target is inside the block)."""
    margin = step.margin
    if margin.normalized:
        # cos = x̂·Ŵᵀ without an `Ŵ` copy: x̂ is pre-scaled by s, column j divided by |W_j|.
        name = block.buffer if step.sub_centers == 1 else block.centre_buffer
        cos = _matmul_rows(step.x_scaled, w, _lend(step, name, [step.n, block.hi - block.lo]))
        scale_columns_(cos, _block_inv_w(step, block, w))
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


def _block_inv_w(step, block, w):
    """1/|W_j| of the block's rows: a slice of the call's on the dense path; on the chunked
    path computed from the block's float32 rows (`w`) when the block's logits are (forward and
    backward) and dropped with them, so no `[C_local]` array lives through the step."""
    if step.inv_w is not None:
        return _rows(step.inv_w, block.lo, block.hi)
    if block.inv_w is None:
        parts = [1.0 / _row_norm(w.get(a, b)) for a, b in w.slabs()]
        block.inv_w = parts[0] if len(parts) == 1 else paddle.concat(parts)
    return block.inv_w


# The forward's stages, in order: gather → logits → max → sum → target → loss.

def _gather(step, features, weight, bias, local_target):
    """Gather: the gathered batch as the logits read it (cosines: |x|, x̂, s·x̂, the margin for
    this batch and, on the dense path, 1/|W|), the blocks of classes, which inputs want a
    gradient."""
    step.n, step.weight, step.bias = features.shape[0], weight, bias
    step.cpu = cpu_set(features)  # the kernel set of this call (slab budgets)
    if step.margin.normalized:
        step.x_norm = _row_norm(features)
        step.margin = step.margin.for_batch(step.x_norm)
        step.x_hat = features / step.x_norm.unsqueeze(1)
        step.x_scaled = step.x_hat * step.margin.scale
    else:
        step.features = features
    step.blocks = _blocks(local_target, weight.shape[0] // step.sub_centers, step.chunk_size,
                          step.sub_centers)
    if step.margin.normalized and len(step.blocks) == 1:  # chunked: a block's at a time
        step.inv_w = _inv_row_norms(step, weight)
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
        block.inv_w = None
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
        inv_w = _block_inv_w(step, block, w)
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


def _gather_grad(step, d_x):
    """Gather, reversed: for cosines, the embedding gradient through x̂ = x/|x|."""
    if d_x is not None and step.margin.normalized:
        x_hat = step.x_hat
        d_x = (d_x - x_hat * row_dot(x_hat, d_x).unsqueeze(1)) / step.x_norm.unsqueeze(1)
    return d_x
