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
"""
import paddle
from paddle.autograd import PyLayer

from ..distributed import all_reduce_

__all__ = ["parallel_softmax_cross_entropy"]

_NORM_EPS = 1e-12  # as paddle.nn.functional.normalize
_SLAB_BYTES = 2 << 20  # temporaries of the in-place weight-gradient correction (cache-sized)
_WGRAD_SLAB = 4096  # classes per weight-gradient GEMM in the chunked path


def _row_norm(x):
    """L2 norm of each row, floored at _NORM_EPS, without an `x`-sized temporary."""
    return paddle.sqrt(paddle.einsum("ij,ij->i", x, x)).clip(min=_NORM_EPS)


def _row_dot(a, b):
    return paddle.einsum("ij,ij->i", a, b)


def _subtract_scaled_rows_(out, rows_of, coef):
    """out -= coef[:, None] * rows_of, in place, a slab of rows at a time."""
    coef = coef.unsqueeze(1)
    step = max(1, _SLAB_BYTES // (4 * out.shape[1]))
    for i in range(0, out.shape[0], step):
        j = i + step
        out[i:j].subtract_(rows_of[i:j] * coef[i:j])


class _Block:
    """The classes [start, stop) of this rank's weight, and each row's target column in it.

    Every row of the batch is addressed (rows whose target lies elsewhere write their own
    value back), so no shape depends on the labels and nothing is read back to the host."""

    def __init__(self, start, stop, local_target):
        self.start, self.stop = start, stop
        self.buffer = f"logits[{stop - start}]"  # workspace name: one buffer per block width
        self.inside = paddle.logical_and(local_target >= start, local_target < stop)
        self.col = paddle.clip(local_target - start, 0, stop - start - 1).unsqueeze(1)
        self.cos_t = None

    def take(self, buf):
        """`[N]` entries of `buf` at each row's target column."""
        return paddle.take_along_axis(buf, self.col, 1, broadcast=False).squeeze(1)

    def put_(self, buf, value, old):
        """Write `value` at the target entries of the rows inside this block, in place."""
        buf.put_along_axis_(self.col, paddle.where(self.inside, value, old).unsqueeze(1), 1,
                            broadcast=False)


def _blocks(local_target, num_local, chunk_size):
    step = num_local if not chunk_size else int(chunk_size)
    return [_Block(s, min(s + step, num_local), local_target) for s in range(0, num_local, step)]


def _block_logits(ctx, block, weight, bias):
    """Logits of one block (margin applied to its targets), written into the workspace's
    buffer for blocks of this width when it lends one; returns (logits, `[N]` target
    logits, meaningful for the rows whose target is inside the block)."""
    w = weight[block.start:block.stop]
    margin = ctx.margin
    out = ctx.workspace.lend(block.buffer, [ctx.n, block.stop - block.start], ctx) \
        if ctx.workspace is not None else None
    if margin.normalized:
        # cos = x̂·Ŵᵀ without an `Ŵ` copy: x̂ is pre-scaled by s, column j divided by |W_j|.
        logits = paddle.matmul(ctx.x_scaled, w, transpose_y=True, out=out)
        logits.multiply_(ctx.inv_w[block.start:block.stop])  # 1-D operand: [1, C] is ~6x slower
        plain = block.take(logits)
        block.cos_t = plain / margin.scale
        target_logit = margin.target_logit(block.cos_t)
        block.put_(logits, target_logit, plain)
    else:
        logits = paddle.matmul(ctx.features, w, transpose_y=True, out=out)
        if bias is not None:
            logits.add_(bias[block.start:block.stop])
        target_logit = block.take(logits)
    return logits, target_logit


def _block_backward(ctx, block, buf, weight, row_scale, d_x, need_w, out_w=None, out_b=None):
    """Gradients from one block of E = exp(logit − max): adds the embedding part to
    `d_x` and returns this block's (weight rows, bias rows) gradients, or writes them
    into `out_w`/`out_b` (the chunked path) a slab of `_WGRAD_SLAB` classes at a time,
    so that no `[chunk, d]` temporary exists. With S the row sum of E and r = g/S,
    dL/dlogit = r·(E − S·onehot); r and the column factors are applied to the small
    GEMM operands, so the GEMMs are the only passes over `buf`."""
    margin = ctx.margin
    w = weight[block.start:block.stop]
    old = block.take(buf)
    target = old - ctx.sum_exp
    if margin.normalized:
        target = target * margin.target_grad(block.cos_t) / margin.scale
    block.put_(buf, target, old)
    if margin.normalized:
        # dL/dcos = s·r·buf; cos = x̂·Ŵᵀ with Ŵ = W·diag(1/|W|).
        inv_w = ctx.inv_w[block.start:block.stop]
        buf.multiply_(inv_w)
        scale = row_scale * margin.scale
        if d_x is not None:
            d_x.add_(paddle.matmul(buf, w) * scale)
        rhs = ctx.x_hat * scale
    else:
        if d_x is not None:
            d_x.add_(paddle.matmul(buf, w) * row_scale)
        rhs = ctx.features * row_scale

    def weight_rows(lo, hi):
        part = buf if (lo, hi) == (0, buf.shape[1]) else buf[:, lo:hi]
        g_w = paddle.matmul(part, rhs, transpose_x=True) if need_w else None
        if need_w and margin.normalized:  # dW_j = P_j − W_j (W_j·P_j) / |W_j|², P = dL/dŴ / |W|.
            w_part, inv = w[lo:hi], inv_w[lo:hi]
            _subtract_scaled_rows_(g_w, w_part, _row_dot(w_part, g_w) * inv * inv)
        g_b = (paddle.matmul(part, row_scale.reshape([-1]), transpose_x=True)
               if ctx.has_bias else None)
        return g_w, g_b

    if out_w is None and out_b is None:
        return weight_rows(0, buf.shape[1])
    for lo in range(0, buf.shape[1], _WGRAD_SLAB):
        hi = min(lo + _WGRAD_SLAB, buf.shape[1])
        g_w, g_b = weight_rows(lo, hi)
        if out_w is not None:
            out_w[block.start + lo:block.start + hi] = g_w
        if out_b is not None:
            out_b[block.start + lo:block.start + hi] = g_b
    return None, None


def _give_back(ctx, block):
    if ctx.workspace is not None:
        ctx.workspace.give_back(block.buffer)


class _ParallelSoftmaxCE(PyLayer):
    """Per-sample loss of the gathered batch; see `parallel_softmax_cross_entropy`."""

    @staticmethod
    def forward(ctx, features, weight, bias, local_target, margin, group, chunk_size, workspace,
                grad_into_weight):
        n = features.shape[0]
        num_local = weight.shape[0]
        ctx.margin, ctx.group, ctx.has_bias = margin, group, bias is not None
        ctx.n, ctx.workspace, ctx.grad_into_weight = n, workspace, grad_into_weight
        if margin.normalized:
            ctx.x_norm = _row_norm(features)
            ctx.x_hat = features / ctx.x_norm.unsqueeze(1)
            ctx.x_scaled = ctx.x_hat * margin.scale
            ctx.inv_w = 1.0 / _row_norm(weight)
        else:
            ctx.features = features
        blocks = _blocks(local_target, num_local, chunk_size)

        if len(blocks) == 1:  # dense: keep exp(logit − max) for the backward
            logits, target_logit = _block_logits(ctx, blocks[0], weight, bias)
            row_max = all_reduce_(logits.max(axis=1), "max", group)
            logits.subtract_(row_max.unsqueeze(1))
            logits.exp_()
            sum_exp = all_reduce_(logits.sum(axis=1), "sum", group)
            ctx.exp_logits = logits
        else:  # chunked: running max and sum, blocks dropped as they go
            run_max = paddle.full([n], float("-inf"), dtype=features.dtype)
            run_sum = paddle.zeros([n], dtype=features.dtype)
            target_logit = paddle.zeros([n], dtype=features.dtype)
            for block in blocks:
                logits, t = _block_logits(ctx, block, weight, bias)
                target_logit = paddle.where(block.inside, t, target_logit)
                new_max = paddle.maximum(run_max, logits.max(axis=1))
                logits.subtract_(new_max.unsqueeze(1))
                logits.exp_()
                run_sum = run_sum * paddle.exp(run_max - new_max) + logits.sum(axis=1)
                run_max = new_max
                del logits
                _give_back(ctx, block)
            row_max = all_reduce_(run_max.clone(), "max", group)
            sum_exp = all_reduce_(run_sum * paddle.exp(run_max - row_max), "sum", group)
            ctx.exp_logits = None

        # log p[target] on the rank that owns the label, 0 elsewhere; the sum over
        # ranks is then the target log-probability of every sample.
        logp = target_logit - row_max - paddle.log(sum_exp)
        target_logp = paddle.where(local_target >= 0, logp, paddle.zeros_like(logp))
        all_reduce_(target_logp, "sum", group)

        ctx.weight, ctx.bias, ctx.blocks = weight, bias, blocks
        ctx.row_max, ctx.sum_exp = row_max, sum_exp
        ctx.grad_mask = (not features.stop_gradient, not weight.stop_gradient)
        if ctx.exp_logits is not None and not any(ctx.grad_mask):
            ctx.exp_logits = None  # no backward will come
            _give_back(ctx, blocks[0])
        return -target_logp

    @staticmethod
    def backward(ctx, grad):
        weight, bias, margin, blocks = ctx.weight, ctx.bias, ctx.margin, ctx.blocks
        row_scale = (grad / ctx.sum_exp).unsqueeze(1)
        need_x, need_w = ctx.grad_mask
        d_x = paddle.zeros([grad.shape[0], weight.shape[1]], dtype=weight.dtype) if need_x else None
        into_weight = need_w and ctx.grad_into_weight
        buf, ctx.exp_logits = ctx.exp_logits, None
        if buf is not None and not into_weight:  # dense: one block, whole gradients at once
            d_w, d_b = _block_backward(ctx, blocks[0], buf, weight, row_scale, d_x, need_w)
            del buf
            _give_back(ctx, blocks[0])
        else:  # block by block (recomputing the logits the forward dropped), rows in slabs
            d_w = (weight if into_weight else paddle.empty(weight.shape, dtype=weight.dtype)) \
                if need_w else None
            d_b = paddle.empty(bias.shape, dtype=bias.dtype) if ctx.has_bias else None
            for block in blocks:
                if buf is None:
                    block_buf, _ = _block_logits(ctx, block, weight, bias)
                    block_buf.subtract_(ctx.row_max.unsqueeze(1))
                    block_buf.exp_()
                else:
                    block_buf, buf = buf, None
                _block_backward(ctx, block, block_buf, weight, row_scale, d_x, need_w, d_w, d_b)
                del block_buf
                _give_back(ctx, block)
        if not need_w:
            d_w = None
        if need_x and margin.normalized:
            x_hat = ctx.x_hat
            d_x = (d_x - x_hat * _row_dot(x_hat, d_x).unsqueeze(1)) / ctx.x_norm.unsqueeze(1)
        if ctx.has_bias:
            return d_x, d_w, d_b, None
        return d_x, d_w, None


def parallel_softmax_cross_entropy(features, weight, bias, local_target, margin, group=None,
                                   chunk_size=None, workspace=None, grad_into_weight=False):
    """Per-sample softmax cross entropy with classes split across ranks.

    Args:
        features: `[N, d]` float32, the gathered global batch (same on every rank).
        weight: `[C_local, d]`, this rank's class centres.
        bias: `[C_local]` or None (used only by the plain `Softmax` margin).
        local_target: `[N]` int64, the label's index into `weight` where this
            rank owns it, -1 elsewhere (see `ClassPartition.shard_labels`).
        margin: a `plsc.loss.Margin`.
        group: process group of the class shards (default: the world).
        chunk_size: None for the dense path, else classes per block of the
            chunked path (memory `[N, chunk_size]` instead of `[N, C_local]`).
        workspace: a `plsc.nn.Workspace` whose buffers the logits are written into
            (kept from step to step), or None to allocate them each call.
        grad_into_weight: `weight` is a scratch copy (Partial FC's gathered rows): the
            backward writes the weight gradient over it, slab by slab as each slab's rows
            are last used, and returns it as the gradient, so no second `[C_local, d]`
            array exists. Its values are gone after the backward.

    Returns `[N]` losses, identical on every rank. Gradients flow to `features`,
    `weight` and `bias`; the gradient of `features` is this rank's share and
    must be summed over ranks (the backward of an all-gather does that).
    """
    if local_target.dtype != paddle.int64:
        local_target = local_target.astype("int64")
    if chunk_size is not None and int(chunk_size) >= weight.shape[0]:
        chunk_size = None
    return _ParallelSoftmaxCE.apply(features, weight, bias, local_target, margin, group, chunk_size,
                                    workspace, grad_into_weight)
