"""Paddle ops launched by one head training step (forward, backward, optimizer update).

Counted with Paddle's profiler (CPU target; `on_trace_ready` does nothing) by walking its
operator events, one profiler session a phase:
- "top": operator events at the top level, a grad node's wrapper (`Global_*GradNode`, the
  backward's per-node event) transparent: the operators run inside it count instead, and a
  grad node that runs none (a built-in op's backward) counts as one;
- "nested": every operator event, nested ones (an op calling ops) included, grad-node wrappers
  not counted;
- "kernels": kernel launch events (`DygraphKernelLaunch`), what a GPU would launch.
"head_step" is forward + backward, "update" the optimizer's step. An 8-bit weight's update
runs inside the backward (`fused_update`: no 8-bit gradient exists), and with `--update fused`
every weight's (the trainer's default, `Optimizer.fused_head_update`), so "head_step" holds
the update and "update" is `end_fused_step`; "head_own" is then the head's forward + backward
with a sink that does nothing. The trainer's own head step is `--update fused --check-inputs
labels` (its "step").

The heads: dense (sample_ratio 1, chunk_size 0), Partial FC 0.1 and chunked (blocks of
`--chunk` classes; PartialFC's default `check_inputs=True`, or `--check-inputs labels` as the
trainer runs it), float32 / bfloat16 / int8 storage (`int8+int4`: int8 centres, 4-bit
state), SGD (SparseMomentum) and AdamW
(SparseAdamW, stochastic rounding), at `--classes` classes (one rank), d = 512, batch 128, on
the CPU kernel set and the device set (`PLSC_KERNELS=device`: Paddle ops only, what a GPU
runs). One warm-up step first (creates the optimizer state). Prints JSON.

    python benchmarks/benchmark_launches.py --classes 100000 1000000 --out launches.json
    python benchmarks/benchmark_launches.py --classes 50000 200000 --heads pfc0.1 \
        --kernel-sets device --update fused --check-inputs labels  # the trainer's step
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import paddle
import paddle.profiler as profiler

from plsc.loss import ArcFace
from plsc.nn import PartialFC
from plsc.optim import SparseAdamW, SparseMomentum

_OPERATOR = profiler.TracerEventType.Operator
_LAUNCH = profiler.TracerEventType.DygraphKernelLaunch


def _is_grad_node(node):
    return node.type == _OPERATOR and "GradNode" in node.name


def _counts(node, inside_op, out):
    """Walk the event tree below `node`, adding to out["top"], out["nested"], out["kernels"]."""
    for child in node.children_node:
        if child.type == _LAUNCH:
            out["kernels"] += 1
        if _is_grad_node(child):
            sub = {"top": 0, "nested": 0, "kernels": 0}
            _counts(child, inside_op, sub)
            out["nested"] += sub["nested"]
            out["kernels"] += sub["kernels"]
            if not inside_op:
                out["top"] += sub["top"] if sub["top"] else 1
            continue
        if child.type == _OPERATOR:
            out["nested"] += 1
            if not inside_op:
                out["top"] += 1
            _counts(child, True, out)
        else:
            _counts(child, inside_op, out)


def count_ops(fn):
    """{"top", "nested", "kernels"} of the Paddle ops `fn()` launches (see the module's doc)."""
    prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], on_trace_ready=lambda p: None)
    prof.start()
    try:
        fn()
    finally:
        prof.stop()
    out = {"top": 0, "nested": 0, "kernels": 0}
    for root in prof.profiler_result.get_data().values():
        _counts(root, False, out)
    return out


HEADS = {"dense": dict(sample_ratio=1.0, chunk_size=0),
         "pfc0.1": dict(sample_ratio=0.1, chunk_size=0),
         "chunked": dict(sample_ratio=1.0, chunk_size=None)}


def optimizer(name, dtype, state=None):
    state = state or (None if dtype == "float32" else dtype)
    if name == "adamw":
        return SparseAdamW(0.001, weight_decay=0.05, state_dtype=state, rounding="stochastic")
    return SparseMomentum(0.1, momentum=0.9, weight_decay=5e-4, state_dtype=state,
                          rounding="stochastic")


def step_counts(head_kind, dtype, opt_name, classes, d=512, batch=128, chunk=16384, seed=0,
                check_inputs=True, fused=False):
    """Counts of one step (after a warm-up step) split by phase, and the step's total;
    `fused`: the update inside the backward (an 8-bit weight's always is)."""
    kw = dict(HEADS[head_kind])
    if kw["chunk_size"] is None:
        kw["chunk_size"] = chunk
    dtype, _, state = dtype.partition("+")  # "int8+int4": int8 centres, 4-bit state
    head = PartialFC(d, classes, ArcFace(), param_dtype=dtype, seed=seed,
                     check_inputs=check_inputs, **kw)
    opt = optimizer(opt_name, dtype, state or None)
    rng = np.random.RandomState(seed)
    x = paddle.to_tensor(rng.normal(size=(batch, d)).astype("float32"))
    x.stop_gradient = False
    y = paddle.to_tensor(rng.randint(0, classes, batch).astype("int64"))
    fused = fused or dtype == "int8"  # an 8-bit weight's gradient goes to the fused update
    holder = {}

    def forward():
        if fused:
            head.row_update = opt.fused_update(head)
        holder["loss"] = head(x, y)

    def backward():
        holder.pop("loss").backward()

    def update():
        if fused:
            opt.end_fused_step(head)
        else:
            opt.step(head)

    for phase in (forward, backward, update):  # warm-up
        phase()
    x.grad = None
    result = {}
    for name, phase in (("forward", forward), ("backward", backward), ("update", update)):
        result[name] = count_ops(phase)
    x.grad = None
    result["step"] = {k: sum(result[p][k] for p in ("forward", "backward", "update"))
                      for k in ("top", "nested", "kernels")}
    result["head_step"] = {k: result["forward"][k] + result["backward"][k]
                           for k in ("top", "nested", "kernels")}
    if fused:  # the update runs inside the backward: the head's own ops, with a null sink
        def own():
            head.row_update = lambda lo, hi, g_w, g_b: None
            head(x, y).backward()
            head.row_update = None
            head.release_sampled_rows()
            x.grad = None
        result["head_own"] = count_ops(own)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"],
                        choices=["float32", "bfloat16", "float16", "int8", "int8+int4"],
                        help="storage of the centres and their state; int8+int4: int8 centres "
                             "with 4-bit state")
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "adamw"],
                        choices=["sgd", "adamw"])
    parser.add_argument("--kernel-sets", nargs="+", default=["cpu", "device"],
                        choices=["cpu", "device"])
    parser.add_argument("--chunk", type=int, default=16384, help="classes a block (chunked)")
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--check-inputs", default="true", choices=["labels", "true"],
                        help="PartialFC's check_inputs: 'true' (its default: one small "
                             "all-gather and read a step) or 'labels' (the trainer's: no read)")
    parser.add_argument("--update", default="after", choices=["after", "fused"],
                        help="the optimizer's update after the backward (8-bit weights: "
                             "inside it) or inside the backward for every weight (fused: the "
                             "trainer's default)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    paddle.set_device("cpu")
    check_inputs = True if args.check_inputs == "true" else "labels"
    rows = []
    for kernels in args.kernel_sets:
        if kernels == "device":
            os.environ["PLSC_KERNELS"] = "device"
        else:
            os.environ.pop("PLSC_KERNELS", None)
        for classes in args.classes:
            for head in args.heads:
                for dtype in args.dtypes:
                    for opt in args.optimizers:
                        t0 = time.perf_counter()
                        counts = step_counts(head, dtype, opt, classes, args.embedding_size,
                                             args.batch_size, args.chunk,
                                             check_inputs=check_inputs,
                                             fused=args.update == "fused")
                        rows.append(dict(kernels=kernels, classes=classes, head=head,
                                         dtype=dtype, optimizer=opt, **counts,
                                         seconds=round(time.perf_counter() - t0, 1)))
                        print(json.dumps({k: rows[-1][k] for k in
                                          ("kernels", "classes", "head", "dtype", "optimizer")}
                                         | {"head_top": counts["head_step"]["top"],
                                            "head_own_top": counts.get("head_own",
                                                                       {}).get("top"),
                                            "update_top": counts["update"]["top"],
                                            "step_top": counts["step"]["top"]}),
                              file=sys.stderr, flush=True)
    report = {"d": args.embedding_size, "batch": args.batch_size, "chunk": args.chunk,
              "check_inputs": args.check_inputs, "update": args.update,
              "paddle": paddle.__version__, "rows": rows}
    text = json.dumps(report, indent=1)
    if args.out:
        from plsc.fileio import atomic_write
        atomic_write(args.out, (text + "\n").encode())
    print(text)


if __name__ == "__main__":
    main()
