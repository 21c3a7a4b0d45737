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

Storage is not compute: the weight (and bias) may be stored in bfloat16 or float16. Each
block of rows is upcast to float32 for its GEMMs (`_rows_f32`, the one place this happens;
Paddle 3.3 has no 16-bit matmul on CPU) and every statistic (row max, sum of exponentials,
target logit, log-probability) is float32.

Sub-centres (K centres a class, class-major rows): a block's GEMM gives the `[N, K·width]`
cosines of its centres; `_class_max` reduces them to the class logits and remembers the winning
centre, `_to_centres` sends each class's gradient back to it. Margins with a `cos_clip`
(AdaFace) clamp the non-target logits (`_clamp_`); those outside the clamp are in the softmax
but get no gradient (`_zero_clamped_`).

The backward works a block (for wide blocks a slab of `_WGRAD_SLAB` classes, copied out of
the block once) at a time: the embedding gradient is summed over them, and the weight gradient
goes where the caller wants it, the same GEMM shapes either way: straight from the GEMM into
the array the backward returns, or to a sink that writes it over the weight (Partial FC's
scratch rows) or gives it to `row_update`, which applies the optimizer to those rows at once,
so that no weight-gradient array exists (at most a 64 MiB block of it).

The element-wise passes over the logits (column scaling, row max, exp, row sums) and the row
dot products go through `plsc.cpu_kernels` (numpy on the tensors' memory on the CPU, Paddle's
ops elsewhere).
"""
import paddle
from paddle.autograd import PyLayer

from ..cpu_kernels import (copy_columns, exp_shifted_, remove_row_components_, row_dot,
                           scale_columns_)
from ..cpu_kernels import row_max as row_max_of
from ..distributed import all_reduce_
from ..numerics import UPCAST_SLAB_BYTES, sqrt_exact, to_float32

__all__ = ["parallel_softmax_cross_entropy"]

_NORM_EPS = 1e-12  # as paddle.nn.functional.normalize
_WGRAD_SLAB = 4096  # classes per weight-gradient GEMM of a wide block (and per fused update)
_WGRAD_BLOCK_BYTES = 64 << 20  # a block's weight gradient up to this size is one GEMM


def _rows_f32(t, start=0, stop=None):
    """Rows [start, stop) of `t` as float32 (a view when `t` is float32, else an upcast copy)."""
    return to_float32(t[start:stop] if (start, stop) != (0, None) else t)


def _inv_row_norms(weight):
    """1/|W_j| of every row, float32; a 16-bit weight is upcast a slab of rows at a time."""
    if weight.dtype == paddle.float32:
        return 1.0 / _row_norm(weight)
    step = max(1, UPCAST_SLAB_BYTES // (4 * weight.shape[1]))
    return paddle.concat([1.0 / _row_norm(_rows_f32(weight, i, i + step))
                          for i in range(0, weight.shape[0], step)])


def _row_norm(x):
    """L2 norm of each row, floored at _NORM_EPS, without an `x`-sized temporary."""
    return sqrt_exact(row_dot(x, x)).clip(min=_NORM_EPS)


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
        self.inside = paddle.logical_and(local_target >= start, local_target < stop)
        self.col = paddle.clip(local_target - start, 0, stop - start - 1).unsqueeze(1)
        self.cos_t = self.pick = self.clamped = None

    def take(self, buf):
        """`[N]` entries of `buf` at each row's target column."""
        return paddle.take_along_axis(buf, self.col, 1, broadcast=False).squeeze(1)

    def put_(self, buf, value, old):
        """Write `value` at the target entries of the rows inside this block, in place."""
        buf.put_along_axis_(self.col, paddle.where(self.inside, value, old).unsqueeze(1), 1,
                            broadcast=False)


def _blocks(local_target, num_classes, chunk_size, sub_centers):
    step = num_classes if not chunk_size else int(chunk_size)
    return [_Block(s, min(s + step, num_classes), local_target, sub_centers)
            for s in range(0, num_classes, step)]


def _lend(ctx, name, shape):
    return ctx.workspace.lend(name, shape, ctx) if ctx.workspace is not None else None


def _class_max(ctx, block, cos):
    """Sub-centres: each class's logit is the largest of its K centres' (`cos`: `[N, K·width]`,
    class-major); `block.pick` keeps which centre (the first of equal ones) for the backward.
    With one centre a class, `cos` itself."""
    k = ctx.sub_centers
    if k == 1:
        return cos
    per_class = cos.reshape([ctx.n, block.stop - block.start, k])
    block.pick = paddle.argmax(per_class, axis=2, keepdim=True, dtype="int32")
    out = paddle.take_along_axis(per_class, block.pick, 2, broadcast=False).squeeze(2)
    _give_back(ctx, block.centre_buffer)
    return out


def _to_centres(ctx, block, buf):
    """The gradient `buf` of the class logits as that of the centres' (`[N, K·width]`): each
    class's entry goes to the centre that won the max, zero to the others."""
    if ctx.sub_centers == 1:
        return buf
    width, k = block.stop - block.start, ctx.sub_centers
    out = _lend(ctx, block.centre_buffer, [ctx.n, width * k])
    out = paddle.zeros([ctx.n, width * k], "float32") if out is None else out.zero_()
    out.reshape([ctx.n, width, k]).put_along_axis_(block.pick.astype("int64"),
                                                    buf.unsqueeze(2), 2, broadcast=False)
    block.pick = None
    return out


def _clamp_(margin, block, logits, plain):
    """Clamp the non-target logits to s·[−cos_clip, cos_clip] in place (margins with a
    `cos_clip`), remembering which were outside: their gradient is zero (`_zero_clamped_`).
    Returns the entries at the target columns now (`plain` when nothing was clamped)."""
    if margin.cos_clip is None:
        return plain
    bound = margin.scale * margin.cos_clip
    block.put_(logits, paddle.zeros_like(plain), plain)  # the target entries are not clamped
    block.clamped = paddle.logical_or(logits > bound, logits < -bound)
    logits.clip_(-bound, bound)
    return block.take(logits)


def _zero_clamped_(block, exp_logits):
    if block.clamped is not None:
        exp_logits.masked_fill_(block.clamped, 0.0)
        block.clamped = None


def _block_logits(ctx, block, w, bias):
    """Logits of one block (`w`: its float32 weight rows; margin applied to its targets), written
    into the workspace's buffer for blocks of this width when it lends one; returns (logits,
    `[N]` target logits, meaningful for the rows whose target is inside the block)."""
    margin = ctx.margin
    if margin.normalized:
        # cos = x̂·Ŵᵀ without an `Ŵ` copy: x̂ is pre-scaled by s, column j divided by |W_j|.
        name = block.buffer if ctx.sub_centers == 1 else block.centre_buffer
        cos = paddle.matmul(ctx.x_scaled, w, transpose_y=True,
                            out=_lend(ctx, name, [ctx.n, block.hi - block.lo]))
        scale_columns_(cos, ctx.inv_w[block.lo:block.hi])
        logits = _class_max(ctx, block, cos)
        plain = block.take(logits)
        block.cos_t = plain / margin.scale
        target_logit = margin.target_logit(block.cos_t)
        block.put_(logits, target_logit, _clamp_(margin, block, logits, plain))
    else:
        logits = paddle.matmul(ctx.features, w, transpose_y=True,
                               out=_lend(ctx, block.buffer, [ctx.n, block.stop - block.start]))
        if bias is not None:
            logits.add_(_rows_f32(bias, block.start, block.stop))
        target_logit = block.take(logits)
    return logits, target_logit


def _block_backward(ctx, block, buf, w, row_scale, d_x):
    """Gradients from one block of E = exp(logit − max) (`w`: the block's float32 rows):
    adds the embedding part to `d_x` and produces the block's weight (and bias) gradient
    rows. With S the row sum of E and r = g/S, dL/dlogit = r·(E − S·onehot); r is applied to
    the small GEMM operands and the output, so the GEMMs are the only passes over `buf` (and,
    for a wide block, the one pass that copies each column slab for them, `_slabs`)."""
    margin = ctx.margin
    old = block.take(buf)
    target = old - ctx.sum_exp
    if margin.normalized:
        target = target * margin.target_grad(block.cos_t) / margin.scale
    block.put_(buf, target, old)
    if margin.normalized:
        # dL/dcos = s·r·buf; cos = x̂·Ŵᵀ with Ŵ = W·diag(1/|W|): column j of buf is divided
        # by |W_j| before both GEMMs.
        buf = _to_centres(ctx, block, buf)
        inv_w = ctx.inv_w[block.lo:block.hi]
        scale = row_scale * margin.scale
        rhs = ctx.x_hat * scale
    else:
        inv_w, scale = None, row_scale
        rhs = ctx.features * row_scale
    if ctx.d_b is not None:  # the bias (plain softmax) has one gradient per class
        paddle.matmul(buf, row_scale.reshape([-1]), transpose_x=True,
                      out=ctx.d_b[block.start:block.stop])
    d_x_block = None
    for lo, hi, part in _slabs(buf, inv_w, rhs.shape[1]):
        if d_x is not None:
            prod = paddle.matmul(part, w if (lo, hi) == (0, buf.shape[1]) else w[lo:hi])
            d_x_block = prod if d_x_block is None else d_x_block.add_(prod)
        if ctx.need_w:
            _weight_grad_rows(ctx, block.lo + lo, block.lo + hi, part, w[lo:hi],
                              None if inv_w is None else inv_w[lo:hi], rhs)
    if d_x_block is not None:
        d_x.add_(d_x_block * scale)


def _slabs(buf, inv_w, d):
    """(lo, hi, columns [lo, hi) of `buf` times `inv_w[lo:hi]`) over the block: the whole
    block, scaled in place, when its weight gradient takes at most `_WGRAD_BLOCK_BYTES`
    (64 MiB); else slabs of `_WGRAD_SLAB` columns, each scaled into one contiguous scratch
    (the GEMMs need contiguous operands, and a column slab of `buf` is a strided view), so the
    scaling and the copy are one pass. Both paths of the weight gradient (into an array, or
    into `ctx.sink`) see the same slabs, so they agree bit for bit whatever the BLAS kernel
    (MKL's AVX2 kernels round a row differently for different row counts)."""
    width = buf.shape[1]
    if width * d * 4 <= _WGRAD_BLOCK_BYTES:
        yield 0, width, buf if inv_w is None else scale_columns_(buf, inv_w)
        return
    scratch = None  # one slab's copy, reused while the slab width stays the same
    for lo in range(0, width, _WGRAD_SLAB):
        hi = min(lo + _WGRAD_SLAB, width)
        scratch = copy_columns(buf, lo, hi, None if inv_w is None else inv_w[lo:hi],
                               out=scratch)
        yield lo, hi, scratch


def _weight_grad_rows(ctx, lo, hi, part, w, inv_w, rhs):
    """Weight rows [lo, hi)'s gradient from their slab `part` of the logits' gradient (its
    columns already divided by |W_j| for normalised logits): P = partᵀ·rhs, and for normalised
    logits the correction dW_j = P_j − W_j (W_j·P_j) / |W_j|² (P is dL/dŴ / |W|). Into
    `ctx.d_w`'s rows the GEMM writes in place; to `ctx.sink` the rows are handed over."""
    out = ctx.d_w[lo:hi] if ctx.d_w is not None else None
    g_w = paddle.matmul(part, rhs, transpose_x=True, out=out)
    if inv_w is not None:
        remove_row_components_(g_w, w, inv_w)
    if ctx.d_w is None:
        ctx.sink(lo, hi, g_w, None)


def _over_weight(weight):
    """A sink writing gradient rows over the rows of `weight` (a scratch copy)."""
    def write(lo, hi, g_w, g_b):
        weight[lo:hi] = g_w
    return write


def _give_back(ctx, *names):
    if ctx.workspace is not None:
        for name in names:
            ctx.workspace.give_back(name)


class _ParallelSoftmaxCE(PyLayer):
    """Per-sample loss of the gathered batch; see `parallel_softmax_cross_entropy`."""

    @staticmethod
    def forward(ctx, features, weight, bias, local_target, margin, group, chunk_size, workspace,
                grad_into_weight, row_update, sub_centers):
        n = features.shape[0]
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.n, ctx.workspace, ctx.sub_centers = n, workspace, sub_centers
        ctx.grad_into_weight, ctx.row_update = grad_into_weight, row_update
        if margin.normalized:
            ctx.x_norm = _row_norm(features)
            margin = margin.for_batch(ctx.x_norm)
            ctx.x_hat = features / ctx.x_norm.unsqueeze(1)
            ctx.x_scaled = ctx.x_hat * margin.scale
            ctx.inv_w = _inv_row_norms(weight)
        else:
            ctx.features = features
        ctx.margin = margin
        blocks = _blocks(local_target, weight.shape[0] // sub_centers, chunk_size, sub_centers)

        if len(blocks) == 1:  # dense: keep exp(logit − max) for the backward
            logits, target_logit = _block_logits(ctx, blocks[0], _rows_f32(weight), bias)
            row_max = all_reduce_(row_max_of(logits), "max", group)
            sum_exp = all_reduce_(exp_shifted_(logits, row_max)[1], "sum", group)
            _zero_clamped_(blocks[0], logits)  # in the sum, but no gradient
            ctx.exp_logits = logits
        else:  # chunked: running max and sum, blocks dropped as they go
            run_max = paddle.full([n], float("-inf"), dtype=features.dtype)
            run_sum = paddle.zeros([n], dtype=features.dtype)
            target_logit = paddle.zeros([n], dtype=features.dtype)
            for block in blocks:
                w = _rows_f32(weight, block.lo, block.hi)
                logits, t = _block_logits(ctx, block, w, bias)
                block.pick = block.clamped = None  # the backward finds them again
                target_logit = paddle.where(block.inside, t, target_logit)
                new_max, block_sum = exp_shifted_(logits, run_max, running=True)
                run_sum = run_sum * paddle.exp(run_max - new_max) + block_sum
                run_max = new_max
                del logits, w
                _give_back(ctx, block.buffer, block.centre_buffer)
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
            _give_back(ctx, blocks[0].buffer, blocks[0].centre_buffer)
        return -target_logp

    @staticmethod
    def backward(ctx, grad):
        weight, bias, margin, blocks = ctx.weight, ctx.bias, ctx.margin, ctx.blocks
        row_scale = (grad / ctx.sum_exp).unsqueeze(1)
        need_x, ctx.need_w = ctx.grad_mask
        d_x = paddle.zeros([grad.shape[0], weight.shape[1]], dtype="float32") if need_x else None
        # Where the gradients go: the bias's into an array; the weight's into an array the
        # backward returns, over Partial FC's scratch rows, or into the optimizer's update.
        ctx.d_b = paddle.empty(bias.shape, dtype="float32") if ctx.has_bias else None
        ctx.d_w = ctx.sink = d_w = None  # d_w: the weight gradient returned
        if ctx.row_update is not None:  # no weight gradient array at all
            ctx.sink = ctx.row_update
        elif ctx.need_w and ctx.grad_into_weight:
            ctx.sink, d_w = _over_weight(weight), weight
        elif ctx.need_w:
            ctx.d_w = d_w = paddle.empty(weight.shape, dtype="float32")
        buf, ctx.exp_logits = ctx.exp_logits, None
        for block in blocks:  # recomputing the logits the forward dropped (chunked path)
            w = _rows_f32(weight, block.lo, block.hi)
            if buf is None:
                block_buf, _ = _block_logits(ctx, block, w, bias)
                exp_shifted_(block_buf, ctx.row_max, want_sum=False)
                _zero_clamped_(block, block_buf)
            else:
                block_buf, buf = buf, None
            _block_backward(ctx, block, block_buf, w, row_scale, d_x)
            del block_buf, w
            _give_back(ctx, block.buffer, block.centre_buffer)
        d_b = ctx.d_b
        if ctx.row_update is not None and d_b is not None:  # the bias's update, at once
            ctx.row_update(0, d_b.shape[0], None, d_b)
            d_b = None
        ctx.d_w = ctx.d_b = ctx.sink = None
        if need_x and margin.normalized:
            x_hat = ctx.x_hat
            d_x = (d_x - x_hat * row_dot(x_hat, d_x).unsqueeze(1)) / ctx.x_norm.unsqueeze(1)
        if ctx.has_bias:
            return d_x, d_w, d_b, None
        return d_x, d_w, None


def parallel_softmax_cross_entropy(features, weight, bias, local_target, margin, group=None,
                                   chunk_size=None, workspace=None, grad_into_weight=False,
                                   row_update=None, sub_centers=1):
    """Per-sample softmax cross entropy with classes split across ranks.

    Args:
        features: `[N, d]` float32, the gathered global batch (same on every rank).
        weight: `[C_local·sub_centers, d]`, this rank's class centres (float32, bfloat16 or
            float16); with sub-centres, class j's are rows j·K … j·K + K − 1.
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

    Returns `[N]` losses, identical on every rank. Gradients flow to `features`,
    `weight` and `bias`; the gradient of `features` is this rank's share and
    must be summed over ranks (the backward of an all-gather does that). A 16-bit
    weight's returned gradient is cast by Paddle to the weight's dtype.
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
    return _ParallelSoftmaxCE.apply(features, weight, bias, local_target, margin, group, chunk_size,
                                    workspace, grad_into_weight, row_update, sub_centers)
