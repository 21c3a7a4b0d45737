"""Memory-balanced softmax cross entropy over class-sharded logits.

Each rank holds the logits of its own classes for the gathered batch,
`[N, C_local]`, in one buffer that is reused in place: logits, then
`exp(logit − max)`, then the gradient. Ranks exchange only `[N]` vectors
(row max, row sum of exponentials, target log-probability). The backward is
written by hand, so autograd never stores the logits or the softmax.
"""
import paddle
from paddle.autograd import PyLayer

from ..distributed import all_reduce_

__all__ = ["parallel_softmax_cross_entropy"]

_NORM_EPS = 1e-12  # as paddle.nn.functional.normalize
_ROW_CHUNK = 1024  # rows per step of the in-place weight-gradient correction (cache-sized)


def _row_norm(x):
    """L2 norm of each row, floored at _NORM_EPS, without an `x`-sized temporary."""
    return paddle.sqrt(paddle.einsum("ij,ij->i", x, x)).clip(min=_NORM_EPS)


def _row_dot(a, b):
    return paddle.einsum("ij,ij->i", a, b)


def _take(x, rows, cols):
    return paddle.gather_nd(x, paddle.stack([rows, cols], axis=1))


def _subtract_scaled_rows_(out, rows_of, coef):
    """out -= coef[:, None] * rows_of, in place, a slab of rows at a time."""
    coef = coef.unsqueeze(1)
    for i in range(0, out.shape[0], _ROW_CHUNK):
        j = i + _ROW_CHUNK
        out[i:j].subtract_(rows_of[i:j] * coef[i:j])


class _ParallelSoftmaxCE(PyLayer):
    """Per-sample loss of the gathered batch; see `parallel_softmax_cross_entropy`."""

    @staticmethod
    def forward(ctx, features, weight, bias, local_target, margin, group):
        n = features.shape[0]
        rows = paddle.nonzero(local_target >= 0).reshape([-1])
        cols = paddle.gather(local_target, rows)
        owned = rows.shape[0] > 0
        cos_t = target_logit = None
        if margin.normalized:
            # cos = x̂·Ŵᵀ without an `Ŵ` copy: scale x̂ by s, then divide column j by |W_j|.
            x_norm = _row_norm(features)
            x_hat = features / x_norm.unsqueeze(1)
            inv_w = 1.0 / _row_norm(weight)
            logits = paddle.matmul(x_hat * margin.scale, weight, transpose_y=True)
            logits.multiply_(inv_w)  # a 1-D operand: Paddle's [1, C] broadcast is ~6x slower
            if owned:
                cos_t = _take(logits, rows, cols) / margin.scale
                target_logit = margin.target_logit(cos_t)
                logits.index_put_((rows, cols), target_logit)
            ctx.x_hat, ctx.x_norm, ctx.inv_w = x_hat, x_norm, inv_w
        else:
            logits = paddle.matmul(features, weight, transpose_y=True)
            if bias is not None:
                logits.add_(bias)
            if owned:
                target_logit = _take(logits, rows, cols)
            ctx.features = features

        row_max = all_reduce_(logits.max(axis=1), "max", group)
        logits.subtract_(row_max.unsqueeze(1))
        logits.exp_()
        sum_exp = all_reduce_(logits.sum(axis=1), "sum", group)

        # log p[target] on the rank that owns the label, 0 elsewhere; the sum over
        # ranks is then the target log-probability of every sample.
        target_logp = paddle.zeros([n], dtype=logits.dtype)
        if owned:
            logp = target_logit - paddle.gather(row_max, rows) - paddle.log(paddle.gather(sum_exp, rows))
            target_logp = paddle.scatter(target_logp, rows, logp)
        all_reduce_(target_logp, "sum", group)

        ctx.margin, ctx.has_bias = margin, bias is not None
        ctx.weight, ctx.exp_logits, ctx.sum_exp = weight, logits, sum_exp
        ctx.rows, ctx.cols, ctx.cos_t = rows, cols, cos_t
        ctx.grad_mask = (not features.stop_gradient, not weight.stop_gradient)
        return -target_logp

    @staticmethod
    def backward(ctx, grad):
        # With E = exp(logit − max) and S its row sum, dL/dlogit = (g/S)·(E − S·onehot).
        # The row factor g/S and the column factors are applied to the small GEMM
        # operands and results, so the only passes over the buffer are the GEMMs.
        margin, weight, buf, sum_exp = ctx.margin, ctx.weight, ctx.exp_logits, ctx.sum_exp
        ctx.exp_logits = None
        rows, cols = ctx.rows, ctx.cols
        row_scale = (grad / sum_exp).unsqueeze(1)
        if rows.shape[0] > 0:
            target = _take(buf, rows, cols) - paddle.gather(sum_exp, rows)
            if margin.normalized:
                target = target * margin.target_grad(ctx.cos_t) / margin.scale
            buf.index_put_((rows, cols), target)

        need_x, need_w = ctx.grad_mask
        d_x = d_w = d_b = None
        if margin.normalized:
            # dL/dcos = s·(g/S)·buf; cos = x̂·Ŵᵀ with Ŵ = W·diag(1/|W|).
            x_hat, x_norm, inv_w = ctx.x_hat, ctx.x_norm, ctx.inv_w
            buf.multiply_(inv_w)
            scale = row_scale * margin.scale
            if need_x:
                d_xhat = paddle.matmul(buf, weight) * scale
                d_x = (d_xhat - x_hat * _row_dot(x_hat, d_xhat).unsqueeze(1)) / x_norm.unsqueeze(1)
            if need_w:
                d_w = paddle.matmul(buf, x_hat * scale, transpose_x=True)
                del buf
                # dW_j = P_j − W_j (W_j·P_j) / |W_j|², P = dL/dŴ / |W|.
                _subtract_scaled_rows_(d_w, weight, _row_dot(weight, d_w) * inv_w * inv_w)
        else:
            features = ctx.features
            if need_x:
                d_x = paddle.matmul(buf, weight) * row_scale
            if need_w:
                d_w = paddle.matmul(buf, features * row_scale, transpose_x=True)
            if ctx.has_bias:
                d_b = paddle.matmul(buf, row_scale.reshape([-1]), transpose_x=True)
        if ctx.has_bias:
            return d_x, d_w, d_b, None
        return d_x, d_w, None


def parallel_softmax_cross_entropy(features, weight, bias, local_target, margin, group=None):
    """Per-sample softmax cross entropy with classes split across ranks.

    Args:
        features: `[N, d]` float32, the gathered global batch (same on every rank).
        weight: `[C_local, d]`, this rank's class centres.
        bias: `[C_local]` or None (used only by the plain `Softmax` margin).
        local_target: `[N]` int64, the label's index into `weight` where this
            rank owns it, -1 elsewhere (see `ClassPartition.shard_labels`).
        margin: a `plsc.loss.Margin`.
        group: process group of the class shards (default: the world).

    Returns `[N]` losses, identical on every rank. Gradients flow to `features`,
    `weight` and `bias`; the gradient of `features` is this rank's share and
    must be summed over ranks (the backward of an all-gather does that).
    """
    if local_target.dtype != paddle.int64:
        local_target = local_target.astype("int64")
    return _ParallelSoftmaxCE.apply(features, weight, bias, local_target, margin, group)
