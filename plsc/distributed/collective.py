"""Collectives used by the head, with gloo fallbacks and autograd rules.

Raw functions (`gather_concat`, `reduce_scatter_sum`, `all_reduce_`) do not
record gradients. `all_gather` and `reduce_scatter` are differentiable: the
backward of an all-gather is a reduce-scatter (sum) and vice versa. For a
world of size 1 every function returns its input.
"""
import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

from ..kernels.cpu_kernels import as_numpy, cpu_set
from ..dtypes import FLOAT_DTYPES

__all__ = ["group_rank_size", "gather_concat", "reduce_scatter_sum", "all_reduce_", "broadcast_",
           "sync_buffers", "all_gather", "reduce_scatter", "failed_rank", "WIRE_DTYPES",
           "start_sum"]

# Backends whose process group implements reduce_scatter (gloo does not).
_REDUCE_SCATTER_BACKENDS = ("NCCL", "BKCL", "XCCL", "FLAGCX")
# Backends whose float16 all-reduce is wrong: gloo in Paddle 3.3.1 returns +inf for every
# non-zero element of a float16 SUM (measured on 2 ranks; its bfloat16 SUM is right).
_NO_FLOAT16_ALL_REDUCE = ("GLOO",)
WIRE_DTYPES = FLOAT_DTYPES  # what `start_sum` may send


def group_rank_size(group=None):
    """(rank, world size) of this process within `group` (default: the world)."""
    if group is not None:
        return group.rank, group.nranks
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def gather_concat(x, group=None):
    """Concatenate `x` of every rank along axis 0, in rank order.

    All ranks must pass tensors of the same shape and dtype.
    """
    _, k = group_rank_size(group)
    if k == 1:
        return x
    parts = []
    dist.all_gather(parts, x, group=group)
    return paddle.concat(parts, axis=0)


def reduce_scatter_sum(x, group=None):
    """Sum `x` over ranks and return this rank's `1/k` slice along axis 0."""
    r, k = group_rank_size(group)
    if k == 1:
        return x
    n = x.shape[0]
    if n % k:
        raise ValueError(f"reduce_scatter needs axis 0 ({n}) divisible by the world size ({k})")
    b = n // k
    if dist.get_backend(group) in _REDUCE_SCATTER_BACKENDS:
        out = paddle.empty([b] + list(x.shape[1:]), dtype=x.dtype)
        dist.reduce_scatter(out, list(paddle.split(x, k, axis=0)), op=dist.ReduceOp.SUM, group=group)
        return out
    total = x.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total[r * b:(r + 1) * b].clone()


def all_reduce_(x, op="sum", group=None):
    """In-place all-reduce with op "sum" or "max"; returns `x`."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    if op not in ops:
        raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
    if group_rank_size(group)[1] > 1:
        dist.all_reduce(x, op=ops[op], group=group)
    return x


def start_sum(x, wire="float32", group=None, issue=None):
    """Start summing the float32 tensor `x` over the ranks of `group` with `wire` values on the
    wire; returns `wait()`, which waits and returns the sum as float32 (for float32: `x`
    itself, summed in place). One process: `x`, rounded to `wire` and back as a one-rank
    all-reduce of `wire` values returns it (float32: nothing rounded).

    float16 or bfloat16: each rank sends `x` rounded to nearest `wire` and receives the sum
    in `wire` (a `wire` all-reduce: half the bytes of float32's on any number of ranks).
    Where the backend's float16 all-reduce is wrong (gloo), the float16 payloads are
    all-gathered instead (each rank sends its float16 `x` to the k-1 others), summed in
    float32 in rank order and rounded to float16 once. On 2 ranks that is what a float16
    all-reduce returns, bit for bit: both give a+b rounded to float16, and rounding the exact
    sum to float32 first changes nothing (24 bits >= 2*11 + 2, so no double rounding); the
    all-gather then moves half float32's bytes too, on 4 ranks as many, beyond that more.

    `issue(call)` runs the collective: `call()` starts it and returns Paddle's task; `issue`
    returns a function that waits for it (default: start it in this thread; the casts
    before and after stay in the caller's thread either way)."""
    issue = issue or _issue_now
    if wire not in WIRE_DTYPES:
        raise ValueError(f"wire must be one of {', '.join(WIRE_DTYPES)}, got {wire!r}")
    if wire == "float32" and group_rank_size(group)[1] == 1:
        return lambda: x
    if group_rank_size(group)[1] == 1:
        with paddle.no_grad():
            rounded = x.astype(wire).astype("float32")
        return lambda: rounded
    if wire == "float32":
        done = issue(lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group, sync_op=False))

        def summed():
            done()
            return x
        return summed
    numpy = wire == "float16" and cpu_set(x)  # numpy's float16 casts: one pass each
    with paddle.no_grad():
        payload = _to_float16(x) if numpy else x.astype(wire)
    if wire == "float16" and dist.get_backend(group) in _NO_FLOAT16_ALL_REDUCE:
        parts = []
        done = issue(lambda: dist.all_gather(parts, payload, group=group, sync_op=False))

        def gathered_sum():
            done()
            if numpy:
                return _float16_sum(parts)
            with paddle.no_grad():
                total = parts[0].astype("float32")
                for part in parts[1:]:  # rank order: the same sum on every rank
                    total = total + part.astype("float32")
                return total.astype(wire).astype("float32")
        return gathered_sum
    done = issue(lambda: dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=group, sync_op=False))

    def reduced():
        done()
        with paddle.no_grad():
            return payload.astype("float32")
    return reduced


def _issue_now(call):
    """`start_sum`'s default `issue`: start the collective here; returns its task's `wait`."""
    return call().wait


def _to_float16(x):
    """float32 CPU tensor `x` rounded to nearest float16 (numpy: one pass, where Paddle's
    cast of a 25 MB bucket takes 1.5x as long)."""
    out = paddle.empty(x.shape, dtype="float16")
    np.copyto(as_numpy(out), as_numpy(x), casting="same_kind")
    return out


def _float16_sum(parts):
    """The gathered float16 `parts` summed in float32 in rank order and rounded to float16
    once, as float32: the Paddle-op branch's arithmetic in three passes instead of about six."""
    total = paddle.empty(parts[0].shape, dtype="float32")
    t = as_numpy(total)
    np.add(as_numpy(parts[0]), as_numpy(parts[1]), out=t, dtype=np.float32)
    for part in parts[2:]:
        np.add(t, as_numpy(part), out=t)
    np.copyto(t, t.astype(np.float16))
    return total


def broadcast_(x, src=0, group=None):
    """In place: every rank's `x` becomes rank `src`'s (a global rank); returns `x`."""
    if group_rank_size(group)[1] > 1:
        dist.broadcast(x, src=src, group=group)
    return x


def sync_buffers(model, src=0, group=None):
    """Give every rank rank `src`'s buffers of `model` and its parameters without gradient
    (BatchNorm's running mean and variance).

    The backbone is data-parallel, but its buffers are not gradients: each rank's BatchNorm
    running statistics follow its own samples, so replicas drift apart while their weights
    stay equal. Called before evaluating and before saving, it makes every rank evaluate with
    exactly the statistics the checkpoint (rank 0's state) holds, so the accuracy logged during
    training is what the saved weights give. Broadcast rather than average: it is what
    torch's DistributedDataParallel does (broadcast_buffers, from rank 0), it is exact (no
    rounding in a sum, no change to rank 0's values), and an average of running variances is
    not the variance of the pooled samples anyway. Returns `model`.
    """
    if group_rank_size(group)[1] == 1:
        return model
    # Paddle's BatchNorm keeps its running statistics as parameters without gradient
    # (`_mean`, `_variance`), not as buffers: both kinds are synchronised.
    tensors = [p for p in model.parameters() if p.stop_gradient] + list(model.buffers())
    with paddle.no_grad():
        for t in {id(t): t for t in tensors if t is not None and t._is_initialized()}.values():
            broadcast_(t, src, group)
    return model


class _Adjoint(PyLayer):
    """`op(x, group)` forward; `adjoint(grad, group)` backward."""

    @staticmethod
    def forward(ctx, x, group, op, adjoint):
        ctx.group, ctx.adjoint = group, adjoint
        return op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.adjoint(grad, ctx.group)


def _differentiable(op, adjoint, x, group):
    """`op(x, group)` with `adjoint` as its backward: `x` itself on one rank, no graph for a constant."""
    if group_rank_size(group)[1] == 1:
        return x
    if x.stop_gradient:
        return op(x, group)
    return _Adjoint.apply(x, group, op, adjoint)


def all_gather(x, group=None):
    """Differentiable all-gather along axis 0; backward is a reduce-scatter (sum)."""
    return _differentiable(gather_concat, reduce_scatter_sum, x, group)


def reduce_scatter(x, group=None):
    """Differentiable reduce-scatter (sum) along axis 0; backward is an all-gather."""
    return _differentiable(reduce_scatter_sum, gather_concat, x, group)


def failed_rank(failed, group=None):
    """The highest rank of `group` whose `failed` is true, or -1: the same on every rank (one
    all-reduce of one value). Ranks call it at the same points so that an error on one of them
    stops all of them there instead of leaving the others waiting in a collective."""
    rank, world = group_rank_size(group)
    if world == 1:
        return rank if failed else -1
    flag = paddle.to_tensor([float(rank + 1 if failed else 0)], dtype="float32")
    return int(all_reduce_(flag, "max", group).item()) - 1
