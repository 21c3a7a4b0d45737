"""The backbone's gradient sum on real gloo ranks, every case in one group
(conftest.run_ranks):

    tests/grad_sync_ranks.py --data DATA --out OUT

For each wire dtype (float32, float16, bfloat16; float16 also on the device kernel set,
`float16_device`) and each way of summing (PATHS: `OverlappedSum`'s modes backward, thread
and after, and `sum_gradients`, "flat"), each rank sums its `local_gradients(rank)` and an
`extra` of `extra_values(rank)`, counting what it hands to Paddle's collectives and when the
first starts; then one trainer step with Optimizer.grad_allreduce_dtype=float16 for each
Optimizer.grad_sync, timed by the step timers. Every rank reports its sums and counts
(tests/rank_report.py, .npz): `<case>.<path>.grad<i>`, `.extra`, `.bytes.<wire dtype>`
(payload bytes this rank sent: an all-reduce's tensor, an all-gather's input, which on 2
ranks is what a ring sends), the event times and `.timing.*`; and `trainer.<mode>.*`.
"""
import argparse
import os
import time

import numpy as np

import rank_report
from plsc.process import ending

SHAPES = ((7, 5), (300,), (3, 4, 2), (64,))
MODES = ("backward", "thread", "after")  # Optimizer.grad_sync (the trainer's own check of it)
WIRES = ("float32", "float16", "bfloat16")


def local_gradients(rank):
    """float32 gradients that differ by rank and element, from 1e-7 (float16 subnormals) to
    3e4 (two of them overflow float16's 65504), with bfloat16 and float16 ties (values halfway
    between two neighbours) in the first array."""
    rng = np.random.RandomState(100 + rank)
    grads = []
    for shape in SHAPES:
        size = int(np.prod(shape))
        g = rng.normal(size=size) * 10.0 ** rng.uniform(-7, 4.5, size)
        grads.append(g.astype(np.float32).reshape(shape))
    first = grads[0].reshape(-1)
    first[:4] = [1.0 + 2.0 ** -8 * (1 + 2 * rank),   # bfloat16 ties: 8 bits, the 9th set
                 -(3.0 + 2.0 ** -7),
                 1.0 + 2.0 ** -11 * (1 + 2 * rank),  # float16 ties: 11 bits, the 12th set
                 2.0 ** -25 * 3]                     # between float16 subnormals
    first[4] = 3.5e4  # float16 overflows in the sum (and bfloat16 does not)
    return grads


def extra_values(rank):
    """A few float32 values that 16 bits cannot hold: their sum must come back float32-exact."""
    return np.array([1.0 + 2.0 ** -20 * (rank + 1), float(rank)], np.float32)


class ByteCount:
    """Counts the payload bytes, by dtype, of Paddle's all-reduces and all-gathers (those of
    `paddle.distributed` call these two functions of its `stream` module, the payload
    positional: an all-reduce's tensor, an all-gather's input) while it is open, in any
    thread; `started` is set when the first of them starts, at `first` (perf_counter)."""

    PAYLOAD = {"all_reduce": 0, "all_gather": 1}  # the payload's position in the call

    def __init__(self):
        import threading
        from paddle.distributed.communication import stream
        self.stream, self.counts = stream, {}
        self.started, self.first = threading.Event(), None
        self.originals = {name: getattr(stream, name) for name in self.PAYLOAD}
        for name, original in self.originals.items():
            setattr(stream, name, self._counted(original, self.PAYLOAD[name]))

    def _counted(self, original, index):
        def wrapper(*args, **kwargs):
            if self.first is None:
                self.first = time.perf_counter()
                self.started.set()
            x = args[index]
            dtype = str(x.dtype).replace("paddle.", "")
            self.counts[dtype] = self.counts.get(dtype, 0) + int(x.size) * x.element_size()
            return original(*args, **kwargs)
        return wrapper

    def close(self):
        for name, original in self.originals.items():
            setattr(self.stream, name, original)
        return self.counts


PATHS = ("backward", "thread", "after", "flat")  # OverlappedSum's modes; sum_gradients
GATE_SECONDS = 5.0
HOLD_SECONDS = 0.2  # the backward's rest after the gate: what a thread's all-reduce runs behind


def gate(count):
    """An identity whose backward waits (at most GATE_SECONDS) until `count`'s first
    collective has started, recording when its wait ended, then goes on for HOLD_SECONDS: on
    the path of the gradient the backward completes last, it holds the backward's end until a
    bucket's all-reduce runs, and leaves that all-reduce time to run behind the backward."""
    from paddle.autograd import PyLayer

    class Gate(PyLayer):
        released = None

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            count.started.wait(GATE_SECONDS)
            Gate.released = time.perf_counter()
            time.sleep(HOLD_SECONDS)
            return grad
    return Gate


def sum_case(rank, wire, path):
    """This rank's sums of `local_gradients(rank)` and of `extra_values(rank)`, the bytes
    counted, and the event order: `first_collective_s` and `backward_end_s` (perf_counter:
    the first collective's start, the return of `backward()`), the gate's release
    (`gate_s`, backward and thread only), the summer's `timing()`: {name: array}."""
    import paddle
    from plsc.train import grad_sync
    from plsc.train.grad_sync import OverlappedSum, sum_gradients
    local = local_gradients(rank)
    params = [paddle.create_parameter(list(g.shape), "float32") for g in local]
    summer = (OverlappedSum(params, bucket_bytes=400 * 4, dtype=wire, mode=path)
              if path != "flat" else None)
    if summer is not None:
        summer.arm()
    extra = paddle.to_tensor(extra_values(rank))
    count = ByteCount()
    gated = path in ("backward", "thread")
    Gate = gate(count)
    # the first parameter's gradient comes last (its term is the deepest in the sum); the
    # gate holds it until a bucket's all-reduce starts, which the others' buckets must do
    first = Gate.apply(params[0]) if gated else params[0]
    loss = sum((p * paddle.to_tensor(g)).sum() for p, g in zip([first] + params[1:], local))
    try:
        # the gradient of sum(p * g) is g exactly; the hooks start the buckets' sums as they fill
        loss.backward()
        backward_end = time.perf_counter()
        if summer is not None:
            summer.finish(extra=extra)
        else:
            bucket = grad_sync.BUCKET
            grad_sync.BUCKET = 400  # several buckets
            try:
                sum_gradients(params, extra=extra, dtype=wire)
            finally:
                grad_sync.BUCKET = bucket
    finally:
        counts = count.close()
    out = {f"grad{i}": p.grad.numpy() for i, p in enumerate(params)}
    out["extra"] = extra.numpy()
    out.update({f"bytes.{dtype}": np.int64(n) for dtype, n in counts.items()})
    out.update(first_collective_s=np.float64(count.first), backward_end_s=np.float64(backward_end))
    if gated:
        out["gate_s"] = np.float64(Gate.released)
    if summer is not None:
        out.update({f"timing.{k}": np.float64(v) for k, v in summer.timing().items()})
        out["buckets"] = np.int64(len(summer.buckets))
    return out


def trainer_case(data, out, rank, mode):
    """One step of the trainer with Optimizer.grad_allreduce_dtype=float16 and grad_sync
    `mode`, timed by the step timers: whether it was applied, its loss, the backbone after
    it, the bytes its gradient sum sent and the step's record (`step.<key>`)."""
    import paddle
    from trainer_common import config, make_backbone
    from trainer_ranks import global_batches
    from plsc.train import Trainer
    from plsc.train import timers
    cfg = config(data, os.path.join(out, f"run_{mode}"),
                 Optimizer={"grad_allreduce_dtype": "float16", "grad_sync": mode})
    trainer = Trainer(cfg, backbone=make_backbone(0))
    images, labels = global_batches(2)[0]
    sl = slice(rank * 3, (rank + 1) * 3)
    count = ByteCount()
    env = {timers.ENV: os.path.join(out, f"steps_{mode}")}
    try:
        with timers.step_timers(trainer, environ=env) as steps:
            loss = trainer.train_step([(paddle.to_tensor(images[sl]),
                                        paddle.to_tensor(labels[sl]))])
            steps.end_step(trainer.step, timers._gradient_sum(trainer.gradient_sum))
    finally:
        counts = count.close()
    result = {"applied": np.int64(trainer.nonfinite.run == 0 and trainer.step == 1),
              "loss": np.float64(loss),
              "grad_elements": np.int64(sum(p.size for p in trainer.backbone.parameters()
                                            if not p.stop_gradient))}
    result.update({f"backbone.{n}": p.numpy() for n, p in trainer.backbone.named_parameters()})
    result.update({f"bytes.{dtype}": np.int64(n) for dtype, n in counts.items()})
    result.update({f"step.{k}": np.float64(v) for k, v in steps.steps[0].items()})
    trainer.close()
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import paddle
    from plsc.distributed import get_rank, init
    paddle.set_device("cpu")
    init()
    rank = get_rank()
    report = {}
    for wire in WIRES:
        for path in PATHS:
            report.update({f"{wire}.{path}.{k}": v for k, v in sum_case(rank, wire, path).items()})
    from plsc.kernels.cpu_kernels import KERNELS_ENV
    os.environ[KERNELS_ENV] = "device"  # float16's gathered sum in Paddle's ops, as on a GPU
    for path in PATHS:
        report.update({f"float16_device.{path}.{k}": v
                       for k, v in sum_case(rank, "float16", path).items()})
    del os.environ[KERNELS_ENV]
    for mode in MODES:
        report.update({f"trainer.{mode}.{k}": v
                       for k, v in trainer_case(args.data, args.out, rank, mode).items()})
    # how this rank ends (plsc.process.ending, as every tool's): a rank of a group of two
    report["rank_of_several"] = np.array(ending.is_rank_of_several())
    rank_report.write_arrays(report)


if __name__ == "__main__":
    main()
    ending.end(0)
