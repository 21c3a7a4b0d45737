"""Summing the backbone's gradients across ranks, during the backward or after it.

`sum_gradients` all-reduces them after the backward in a few flat buckets. `OverlappedSum`
starts those all-reduces during the backward: each parameter's hook (Paddle calls it once a
backward, after the parameter's gradient is complete) counts it in, and a bucket (about 25 MB
of gradients, filled in reverse parameter order, the order the backward completes them) is
all-reduced without waiting as soon as all its gradients are there; `finish` sends the rest,
waits for every bucket and writes the sums back. Each element is the same sum of the same
values either way (the buckets only group elements), so on two ranks the results are equal
bit for bit; on more ranks gloo's and NCCL's ring may add in another order where the bucket
boundaries differ (float32 rounding).

`dtype` float16 or bfloat16 (Optimizer.grad_allreduce_dtype) sends the gradients in 16 bits,
as arcface_torch's train_v2.py does with DDP's fp16 compression hook (cast, all-reduce, cast
back: half the bytes; `plsc.distributed.start_sum` says what the wire carries on gloo). That
hook also divides by the world size before its all-reduce, because DDP averages: each torch
rank's loss is its local mean. plsc's convention sums (the head's loss is the global-batch
mean, so each rank's gradient already carries the 1/k), so nothing is divided here: the values
rounded to 16 bits are those torch's hook sums (torch's local-mean gradient over k), of the
same magnitude, with the same overflow point. On one rank too the gradients are rounded to
16 bits and back, as the hook's 1-rank all-reduce does (a recipe's single-GPU run). The `extra`
values (flags the trainer counts) are always summed in float32.
"""
import functools

import paddle

from .. import distributed as pd

__all__ = ["BUCKET", "OVERLAP_BUCKET_BYTES", "OverlappedSum", "sum_gradients"]

BUCKET = 1 << 24  # elements per all-reduce of `sum_gradients`
OVERLAP_BUCKET_BYTES = 25 << 20  # gradient bytes per all-reduce of `OverlappedSum`


def _reduce_flat(bucket, group, dtype="float32"):
    """Concatenate the tensors of `bucket` and start their sum with `dtype` values on the
    wire; returns `wait()`, which returns the flat float32 sum."""
    with paddle.no_grad():
        flat = paddle.concat([b.reshape([-1]) for b in bucket])
    return pd.start_sum(flat, dtype, group)


def _write_back(bucket, flat):
    with paddle.no_grad():
        offset = 0
        for b in bucket:
            b.copy_(flat[offset:offset + b.size].reshape(b.shape), False)
            offset += b.size


def sum_gradients(params, group=None, extra=None, dtype="float32"):
    """All-reduce (SUM) the gradients of `params` in a few flat buckets, with `dtype` values on
    the wire. `extra`, a float32 tensor of a few values, rides along in the last bucket (in
    a float32 all-reduce of its own with a 16-bit `dtype`); returns it summed."""
    grads = [p.grad for p in params if p.grad is not None]
    if pd.group_rank_size(group)[1] == 1 and dtype == "float32":
        return extra
    if extra is not None and dtype == "float32":
        grads.append(extra)
    elif extra is not None:
        _write_back([extra], _reduce_flat([extra], group)())
    bucket, size = [], 0
    for g in grads + [None]:
        if g is not None:
            bucket.append(g)
            size += g.size
        if bucket and (g is None or size >= BUCKET):
            _write_back(bucket, _reduce_flat(bucket, group, dtype)())
            bucket, size = [], 0
    return extra


class OverlappedSum:
    """`sum_gradients` started during the backward (see the module's docstring).

    `arm()` before the backward whose gradients are to be summed (the last micro-batch's: the
    hooks of earlier backwards do nothing); `finish(extra)` after it, instead of
    `sum_gradients(params, group, extra, dtype)`. Without `arm`, `finish` sends every bucket
    then. `dtype`: what the wire carries (float32, float16, bfloat16)."""

    def __init__(self, params, group=None, bucket_bytes=OVERLAP_BUCKET_BYTES, dtype="float32"):
        if dtype not in pd.WIRE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(pd.WIRE_DTYPES)}, got {dtype!r}")
        self.params = [p for p in params if not p.stop_gradient]
        self.group, self.dtype = group, dtype
        self.buckets, self._bucket_of = [], {}
        size = 0
        for p in reversed(self.params):  # the backward completes the last layers first
            nbytes = p.size * p.element_size()
            if not self.buckets or (self.buckets[-1] and size + nbytes > bucket_bytes):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
            self._bucket_of[id(p)] = len(self.buckets) - 1
        self._armed = False
        self._ready = [0] * len(self.buckets)
        self._sent = {}  # bucket -> (its gradients, wait() giving their flat sum)
        self._error = None  # what a hook's all-reduce raised (e.g. a lost rank), for `finish`
        if pd.group_rank_size(group)[1] > 1:
            for p in self.params:
                p._register_backward_hook(functools.partial(self._gradient_ready, id(p)))

    def arm(self):
        """The next backward's completed gradients are all-reduced as their buckets fill
        (buckets an earlier armed backward sent are waited for and dropped)."""
        for _, wait in self._sent.values():
            wait()
        self._armed = True
        self._ready = [0] * len(self.buckets)
        self._sent = {}
        self._error = None

    def _gradient_ready(self, key, *args):
        if not self._armed or self._error is not None:
            return
        b = self._bucket_of[key]
        self._ready[b] += 1
        if self._ready[b] == len(self.buckets[b]):
            try:
                self._send(b)
            except Exception as err:  # noqa: BLE001 -- raised by `finish`: Paddle's backward
                self._error = err  # turns an error in a hook into a SystemError without it

    def _send(self, b, extra=None):
        grads = [p.grad for p in self.buckets[b] if p.grad is not None] if b is not None else []
        if extra is not None:
            grads.append(extra)
        if grads:  # `extra` (b None) goes alone, in float32
            self._sent[b] = (grads, _reduce_flat(grads, self.group,
                                                 self.dtype if b is not None else "float32"))

    def finish(self, extra=None):
        """Send the buckets not sent yet (gradients the backward did not reach, or all of
        them without `arm`) and `extra` (a float32 tensor of a few values, in a bucket of its
        own), wait for all, write the sums into the gradients; returns `extra` summed. An
        error of an all-reduce started during the backward (a lost rank) is raised here."""
        self._armed = False
        if self._error is not None:
            error, self._error, self._sent = self._error, None, {}
            raise error
        if pd.group_rank_size(self.group)[1] == 1 and self.dtype == "float32":
            return extra  # (16 bits: one rank's gradients rounded as a 1-rank all-reduce would)
        for b in range(len(self.buckets)):
            if b not in self._sent:
                self._send(b)
        self._send(None, extra)
        for grads, wait in self._sent.values():
            _write_back(grads, wait())
        self._sent = {}
        return extra
