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
weight in 8 bits per value with a scale per row (`plsc.storage.int8.Int8Rows`, which is no Paddle
tensor: its gradient goes to `row_update`). Each block of rows is read as float32 for its GEMMs
(`storage.read`, the one place this happens; Paddle 3.3 has no 16-bit matmul on CPU) and every
statistic (row max, sum of exponentials, target logit, log-probability) is float32. The
element-wise passes over the logits and the row dot products go through `plsc.kernels.cpu_kernels`
(numpy on the tensors' memory on the CPU, Paddle's ops elsewhere).

The code, one trick per module (this one is the entry: the PyLayer and its options):

- `softmax_blocks`: the call's state (`_Step`, which the PyLayer's `ctx` holds), its blocks
  of classes and the weight rows as the GEMMs read them;
- `softmax_stages`: the forward's stages gather → logits → max → sum → target → loss and the
  backward's way back through them, dense and chunked;
- `subcenters`: K centres per class, the class logit the largest of its centres';
- `conflict_filter`: inter-class filtering and a margin's `cos_clip`, entries in the softmax's
  sum without gradient;
- `grad_sinks`: where the weight gradient goes (an array, the weight's own scratch rows, a
  16-bit array, or `row_update`, the optimizer applied in the backward).

The slab budgets below are read at each call (a test may lower them).
"""
import paddle
from paddle.autograd import PyLayer

from ..kernels.cpu_kernels import DEVICE_SLAB_BYTES, as_numpy
from ..loss.table import check_normalised
from .. import storage
from .conflict_filter import filter_bound
from .grad_sinks import _close_grads, _open_grads
from .softmax_blocks import _BlockRows, _SlabBudget, _Step, _give_back, put_along_
from .softmax_stages import (_gather, _gather_grad, _logits, _logits_grad, _loss, _loss_grad,
                             _max, _sum, _sum_grad, _target, _target_grad)

# `filter_bound` and `put_along_` were written here and are still importable from here;
# `as_numpy` stays a name of this module for the tests that replace it in each module that
# held it (the numpy passes now look it up on `plsc.kernels.cpu_kernels`).
__all__ = ["parallel_softmax_cross_entropy", "filter_bound", "put_along_", "as_numpy"]

_WGRAD_SLAB = 4096  # classes per weight-gradient GEMM of a wide block (and per fused update)
# A 16- or 8-bit block's weight gradient (and float32 rows) up to this size is one GEMM: one
# 4,096-row slab at d = 512. Wider blocks go a slab at a time, so the step's fixed buffers
# beside its logits are slabs, not blocks (docs/memory_and_benchmarks.md).
_WGRAD_BLOCK_BYTES = 8 << 20
# A float32 weight's budget, in those: 64 MiB, a 25,000-class block's gradient at d = 512 in
# one GEMM, scaled in place (its slabs cost 1.5-2.4 % of a chunked step and no peak memory:
# docs/memory_and_benchmarks.md, "The logit-free head").
_F32_WGRAD_BLOCKS = 8
# The device set's budget for the same (and for a narrow block's float32 rows): one slab of
# `DEVICE_SLAB_BYTES` (256 MiB), so a Partial FC step's sampled rows are one slab.
_DEVICE_WGRAD_BYTES = DEVICE_SLAB_BYTES


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
            block.inv_w = None
            _give_back(step, block.buffer, block.centre_buffer)
        d_b = _close_grads(step)
        d_x = _gather_grad(step, d_x)
        # One gradient per tensor passed to `apply`, in the order they were passed there (an
        # 8-bit weight is no tensor).
        grads = (d_x,) + ((d_w,) if storage.has_autograd(step.weight) else ())
        return grads + ((d_b,) if step.bias is not None else ()) + (None,)


def wgrad_block_bytes(float32):
    """Bytes of a block's weight gradient that one GEMM takes on the CPU set, for a float32
    weight or (`float32` false) a 16- or 8-bit one."""
    return _WGRAD_BLOCK_BYTES * (_F32_WGRAD_BLOCKS if float32 else 1)


def _new_step(weight, margin, group, chunk_size, workspace, grad_into_weight, row_update,
              sub_centers, threshold):
    """The call's `_Step`: the options checked, the dense path where one block would hold every
    class anyway, the filtering bound, and the slab budgets as they are now."""
    sub_centers = int(sub_centers)
    if sub_centers < 1 or weight.shape[0] % sub_centers:
        raise ValueError(f"sub_centers must be a positive divisor of the weight's {weight.shape[0]} "
                         f"rows, got {sub_centers}")
    check_normalised(margin, sub_centers, threshold)
    if chunk_size is not None and int(chunk_size) * sub_centers >= weight.shape[0]:
        chunk_size = None
    filter_above = filter_bound(threshold, margin.scale) if threshold > 0 else None
    block_bytes = wgrad_block_bytes(storage.is_float32(weight))
    budget = _SlabBudget(block_bytes, _WGRAD_SLAB, _DEVICE_WGRAD_BYTES)
    return _Step(margin, group, chunk_size, workspace, grad_into_weight, row_update, sub_centers,
                 filter_above, budget)


def parallel_softmax_cross_entropy(features, weight, bias, local_target, margin, group=None,
                                   chunk_size=None, workspace=None, grad_into_weight=False,
                                   row_update=None, sub_centers=1,
                                   interclass_filtering_threshold=0.0):
    """Per-sample softmax cross entropy with classes split across ranks.

    Args:
        features: `[N, d]` float32, the gathered global batch (same on every rank).
        weight: `[C_local·sub_centers, d]`, this rank's class centres (float32, bfloat16 or
            float16, or a `plsc.storage.int8.Int8Rows` with `row_update`); with sub-centres, class
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
        sub_centers: K centres per class (normalised margins only): a class's cosine is the
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
    step = _new_step(weight, margin, group, chunk_size, workspace, grad_into_weight, row_update,
                     sub_centers, interclass_filtering_threshold)
    # Paddle matches the backward's gradients to the tensors in the order they are passed here
    # (features, weight, bias, local_target), keywords included.
    return _ParallelSoftmaxCE.apply(features=features, weight=weight, bias=bias,
                                    local_target=local_target, step=step)
