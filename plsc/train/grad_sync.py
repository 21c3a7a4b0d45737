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
import queue
import threading
import time

import paddle

from .. import distributed as pd
from ..config import GRAD_SYNC_MODES as MODES

__all__ = ["BUCKET", "MODES", "OVERLAP_BUCKET_BYTES", "OverlappedSum", "sum_gradients",
           "resolve_mode"]

BUCKET = 1 << 24  # elements per all-reduce of `sum_gradients`
OVERLAP_BUCKET_BYTES = 25 << 20  # gradient bytes per all-reduce of `OverlappedSum`


def _reduce_flat(bucket, group, dtype="float32", issue=None):
    """Concatenate the tensors of `bucket` and start their sum with `dtype` values on the
    wire (`issue`: `start_sum`'s); returns `wait()`, which returns the flat float32 sum."""
    with paddle.no_grad():
        flat = paddle.concat([b.reshape([-1]) for b in bucket])
    return pd.start_sum(flat, dtype, group, issue)


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


def resolve_mode(mode, device=None):
    """`mode` with "auto" resolved for `device` (Paddle's current one by default): "thread" on
    the CPU, where gloo runs a hook's all-reduce to its end and only a thread lets the backward
    go on (1.6-1.8 % of IResNet50's step, docs/performance.md), "backward" on a GPU, where the
    hooks' all-reduces are asynchronous without a thread."""
    if mode != "auto":
        return mode
    device = paddle.get_device() if device is None else device
    return "thread" if str(device).startswith("cpu") else "backward"


class _CommThread:
    """A daemon thread that runs collectives one after the other, in submission order."""

    def __init__(self):
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._run, name="plsc-gradient-sum", daemon=True).start()

    def _run(self):
        while True:
            call, done = self._jobs.get()
            start = time.perf_counter()
            try:
                call().wait()
            except BaseException as err:  # noqa: BLE001 -- raised in the waiting thread
                done.error = err
            done.seconds = time.perf_counter() - start
            done.set()

    def submit(self, call):
        """Queue `call` (starts a collective, returns its task); returns an Event set once
        it has ended, with `.seconds` (its time) and `.error` (what it raised, or None)."""
        done = threading.Event()
        done.seconds, done.error = 0.0, None
        self._jobs.put((call, done))
        return done


class OverlappedSum:
    """`sum_gradients` started during the backward (see the module's docstring).

    `arm()` before the backward whose gradients are to be summed (the last micro-batch's: the
    hooks of earlier backwards do nothing); `finish(extra)` after it, instead of
    `sum_gradients(params, group, extra, dtype)`. Without `arm`, `finish` sends every bucket
    then. `dtype`: what the wire carries (float32, float16, bfloat16). `mode`
    (Optimizer.grad_sync): "backward", the hooks start each full bucket's all-reduce in the
    backward's thread (asynchronous where the backend's `sync_op=False` is, as NCCL's; Paddle
    3.3's gloo runs it to the end inside the hook); "thread", the hooks hand it to a thread
    of this process that runs the all-reduces in order, on a process group of its own (its
    messages never meet the head's), while the backward goes on; "after", every bucket is
    sent by `finish` (`arm` does nothing); "auto", `resolve_mode`'s choice.

    `timing()` after `finish`: how long the step's all-reduces ran, as far as seen (gloo's,
    which end when their call returns, and the thread's; on NCCL the part after the call is
    not seen), how long this thread waited for them, and how many buckets the backward sent."""

    def __init__(self, params, group=None, bucket_bytes=OVERLAP_BUCKET_BYTES, dtype="float32",
                 mode="backward"):
        if dtype not in pd.WIRE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(pd.WIRE_DTYPES)}, got {dtype!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        mode = resolve_mode(mode)
        self.params = [p for p in params if not p.stop_gradient]
        self.group, self.dtype, self.mode = group, dtype, mode
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
        self._comm = None
        self._times = dict.fromkeys(("ran", "waited", "hidden", "in_backward"), 0)
        world = pd.group_rank_size(group)[1]
        if world > 1 and mode == "thread":
            ranks = None if group is None else group.ranks  # the same ranks, own connections
            self.group = (pd.gloo_group(ranks) if str(pd.get_backend()).lower() == "gloo"
                          else paddle.distributed.new_group(ranks))
            self._comm = _CommThread()
        if world > 1 and mode != "after":
            for p in self.params:
                p._register_backward_hook(functools.partial(self._gradient_ready, id(p)))

    def arm(self):
        """The next backward's completed gradients are all-reduced as their buckets fill
        (buckets an earlier armed backward sent are waited for and dropped)."""
        for _, wait in self._sent.values():
            wait()
        self._armed = self.mode != "after"
        self._ready = [0] * len(self.buckets)
        self._sent = {}
        self._error = None
        self._times = dict.fromkeys(self._times, 0)

    def timing(self):
        """The last `finish`'s all-reduces: {"ran_s": seconds they ran as seen, "waited_s":
        seconds this thread was blocked in them, "hidden_s": of each all-reduce's run, the
        part this thread did not wait for, summed, "in_backward": buckets the backward's hooks
        sent}. Per all-reduce, so that one's hand-over latency (a wait longer than its run)
        does not cancel another's hidden run."""
        t = self._times
        return {"ran_s": t["ran"], "waited_s": t["waited"], "hidden_s": t["hidden"],
                "in_backward": t["in_backward"]}

    def _issue(self, call):
        """`start_sum`'s `issue`: the collective in this thread, or on the communication
        thread; counts the seconds it ran and those this thread waited."""
        times, clock = self._times, time.perf_counter
        if self._comm is None:
            start = clock()
            task = call()
            seconds = clock() - start
            times["ran"] += seconds
            times["waited"] += seconds

            def wait():
                start = clock()
                task.wait()
                seconds = clock() - start
                times["ran"] += seconds
                times["waited"] += seconds
            return wait
        done = self._comm.submit(call)

        def wait():
            start = clock()
            done.wait()
            waited = clock() - start
            times["waited"] += waited
            times["ran"] += done.seconds
            times["hidden"] += max(0.0, done.seconds - waited)
            if done.error is not None:
                raise done.error
        return wait

    def _gradient_ready(self, key, *args):
        if not self._armed or self._error is not None:
            return
        b = self._bucket_of[key]
        self._ready[b] += 1
        if self._ready[b] == len(self.buckets[b]):
            try:
                self._send(b)
                self._times["in_backward"] += 1
            except Exception as err:  # noqa: BLE001 -- raised by `finish`: Paddle's backward
                self._error = err  # turns an error in a hook into a SystemError without it

    def _send(self, b, extra=None):
        grads = [p.grad for p in self.buckets[b] if p.grad is not None] if b is not None else []
        if extra is not None:
            grads.append(extra)
        if grads:  # `extra` (b None) goes alone, in float32
            wire = self.dtype if b is not None else "float32"
            self._sent[b] = (grads, _reduce_flat(grads, self.group, wire, self._issue))

    def finish(self, extra=None):
        """Send the buckets not sent yet (gradients the backward did not reach, or all of
        them without `arm`) and `extra` (a float32 tensor of a few values, in a bucket of its
        own), wait for all, write the sums into the gradients; returns `extra` summed. An
        error of an all-reduce started during the backward (a lost rank) is raised here."""
        if not self._armed:
            self._times = dict.fromkeys(self._times, 0)
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
        sent, self._sent = self._sent, {}
        for grads, wait in sent.values():
            _write_back(grads, wait())
        return extra
