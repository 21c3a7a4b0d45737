"""Launches and time of one sparse-row optimizer update (`plsc.optim`), on both kernel sets.

One update of k sampled rows of width d (a Partial FC step's head update without the forward
and backward) for SGD with momentum and AdamW with float32, bfloat16 (stochastic rounding) and
int8 storage. Reported for each case and kernel set (`PLSC_KERNELS` unset: the CPU set on this
machine; `device`: Paddle ops only, what a GPU runs): the Paddle ops the update launches,
counted with Paddle's profiler (operator events; `top`: those not nested in another operator,
`all`: every operator event), and the update's wall time (median of `--repeat` runs after one
warm-up). Only public APIs, so the same script measures an older checkout (PYTHONPATH).

    python benchmarks/benchmark_optimizer_ops.py --rows 12800 128000 --dim 512
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
import paddle
from paddle.profiler import Profiler, ProfilerTarget, TracerEventType

from plsc.optim import SparseAdamW, SparseMomentum
from plsc.storage.int8 import Int8Rows

CASES = {  # name: (optimizer class, storage of the centres and state)
    "sgd_float32": (SparseMomentum, "float32"),
    "adamw_float32": (SparseAdamW, "float32"),
    "sgd_bfloat16": (SparseMomentum, "bfloat16"),
    "adamw_bfloat16": (SparseAdamW, "bfloat16"),
    "sgd_int8": (SparseMomentum, "int8"),
    "adamw_int8": (SparseAdamW, "int8"),
}


class Head:
    """What the optimizers read of a PartialFC after its backward: the weight, the sampled
    rows and their float32 gradient."""

    def __init__(self, weight, index, grad):
        self.weight, self.bias, self.rank = weight, None, 0
        self.sampled_rows = self.sampled_index = index
        self.row_update = None
        self._grad = grad

    def row_gradient(self, name):
        return self._grad if name == "weight" else None

    def release_sampled_rows(self, gradients_kept=False):
        pass

    def drop_dense_gradients(self):
        pass


def make(case, rows, dim, seed=0):
    cls, dtype = CASES[case]
    rng = np.random.RandomState(seed)
    n = rows + rows // 4  # the shard: a fifth of its rows are not sampled
    w = paddle.to_tensor(rng.standard_normal((n, dim)).astype(np.float32) * 0.05)
    weight = Int8Rows.from_float(w) if dtype == "int8" else w.astype(dtype)
    index = paddle.to_tensor(np.sort(rng.choice(n, rows, replace=False)).astype(np.int64))
    grad = paddle.to_tensor(rng.standard_normal((rows, dim)).astype(np.float32) * 0.01)
    opt = cls(0.1, weight_decay=5e-4, rounding="stochastic")
    head = Head(weight, index, grad)
    opt.init_state(head)
    return opt, head


def count_ops(fn):
    """(top-level, all) operator events of Paddle's profiler while `fn` runs."""
    prof = Profiler(targets=[ProfilerTarget.CPU], on_trace_ready=lambda p: None)
    prof.start()
    fn()
    prof.stop()
    top = total = 0

    def walk(node, inside):
        nonlocal top, total
        is_op = node.type == TracerEventType.Operator
        if is_op:
            total += 1
            top += 0 if inside else 1
        for child in node.children_node:
            walk(child, inside or is_op)
    for root in prof.profiler_result.get_data().values():
        walk(root, False)
    return top, total


def measure(case, rows, dim, kernels, repeat):
    if kernels == "device":
        os.environ["PLSC_KERNELS"] = "device"
    else:
        os.environ.pop("PLSC_KERNELS", None)
    opt, head = make(case, rows, dim)
    opt.step(head)  # warm-up (first-use tables, constants)
    top, total = count_ops(lambda: opt.step(head))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        opt.step(head)
        times.append(time.perf_counter() - t0)
    return {"case": case, "rows": rows, "dim": dim, "kernels": kernels, "ops_top": top,
            "ops_all": total, "seconds": statistics.median(times)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[12800, 128000])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--kernels", nargs="+", default=["cpu", "device"], choices=["cpu", "device"])
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    out = [measure(case, rows, args.dim, kernels, args.repeat)
           for rows in args.rows for case in args.cases for kernels in args.kernels]
    print(json.dumps({"paddle": paddle.__version__, "threads": os.cpu_count(),
                      "results": out}, indent=1))


if __name__ == "__main__":
    main()
