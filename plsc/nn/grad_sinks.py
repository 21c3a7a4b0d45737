"""Where the backward's gradients go. The embedding's is summed into one `[N, d]` array; the
weight's goes, a block (or a slab of `_SlabBudget.slab` classes, copied out of the block once)
at a time, the same GEMM shapes either way, to one of:

- an array the backward returns (float32: straight from the GEMM into its rows);
- a sink (`step.sink(lo, hi, weight_grad, bias_grad)`) that writes it over the weight itself
  (`_over_weight`: Partial FC's scratch rows), rounds it into a 16-bit array (`_into_narrow`),
  or is `row_update`, which applies the optimizer to those rows at once, so that no
  weight-gradient array exists (at most one block of it, `wgrad_block_bytes`).

`_open_grads` chooses at the start of the backward, `_slabs` and `_weight_grad_rows` produce
the rows, `_close_grads` hands over the bias's and drops the arrays.
"""
import paddle

from ..kernels.cpu_kernels import copy_columns, remove_row_components_, scale_columns_
from ..kernels.numerics import cast_nearest
from .softmax_blocks import _wgrad_plan


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


def _slabs(step, buf, inv_w, d):
    """(lo, hi, columns [lo, hi) of `buf` times `inv_w[lo:hi]`) over the block: the whole
    block, scaled in place, when its weight gradient takes at most the budget's `block_bytes`
    (64 MiB for a float32 weight, 8 MiB for a 16- or 8-bit one); else slabs of `slab`
    columns, each scaled into one contiguous scratch (the GEMMs need contiguous operands, and
    a column slab of `buf` is a strided view), so the scaling and the copy are one pass. Both
    paths of the weight gradient (into an array, or into `step.sink`) see the same slabs, so
    they agree bit for bit whatever the BLAS kernel (MKL's AVX2 kernels round a row
    differently for different row counts)."""
    width = buf.shape[1]
    budget, slab = _wgrad_plan(step, d)
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
