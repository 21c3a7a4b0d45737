"""The bytes a real training step hands to Paddle's collectives, counted on gloo ranks
(conftest.run_ranks), for several configurations in one group:

    tests/plan_ranks.py --data DATA --out OUT

For each case of `CASES`, a Trainer is built from trainer_common.config with the case's
sections; one optimizer step warms it up (the optimizer state is created), then the next step
(`Trainer.train_step`) and one stop agreement (`StopSignals.agree`, which the loop runs before
every step) run while Paddle's collective entry points (`paddle.distributed.communication.
stream`: all_reduce, all_gather, reduce_scatter, broadcast) are wrapped to record each call's
op, dtype and payload bytes (an all-reduce's tensor, an all-gather's input, a reduce-scatter's
input list). Each rank reports {case: [[op, dtype, bytes], ...]} (tests/rank_report.py), and under
"gloo_groups" the sums of `gloo_group_sums`.
"""
import argparse
import os
import time

import numpy as np

import rank_report

CASES = {
    "sgd_dense_fp32wire": {"Loss": {"param_dtype": "float32"}},
    "pfc_int8_fp16wire": {"Model": {"name": "IResNet18"},  # 45 MB of gradients at 16x16: 2 buckets
                          "Loss": {"sample_ratio": 0.5, "param_dtype": "int8"},
                          "Optimizer": {"grad_allreduce_dtype": "float16"}},
    "adamw_bf16_subcentres_accumulate": {
        "Model": {"embedding_size": 48},
        "Loss": {"param_dtype": "bfloat16", "sub_centers": 2, "chunk_size": 5},
        "Optimizer": {"name": "adamw", "lr": 0.001, "accumulate_steps": 2,
                      "grad_allreduce_dtype": "bfloat16"}},
}
PAYLOAD = {"all_reduce": 0, "all_gather": 1, "reduce_scatter": 1, "broadcast": 0}


class Counter:
    """Records (op, dtype, bytes) of every call into Paddle's collective stream functions."""

    def __init__(self):
        from paddle.distributed.communication import stream
        self.stream, self.calls, self.on = stream, [], False
        self.originals = {op: getattr(stream, op) for op in PAYLOAD}
        for op, fn in self.originals.items():
            setattr(stream, op, self._wrap(op, fn))

    def _wrap(self, op, fn):
        def wrapper(*args, **kwargs):
            if self.on:
                x = args[PAYLOAD[op]]
                parts = x if isinstance(x, (list, tuple)) else [x]
                nbytes = sum(int(t.size) * t.element_size() for t in parts)
                self.calls.append([op, str(parts[0].dtype).replace("paddle.", ""), nbytes])
            return fn(*args, **kwargs)
        return wrapper


def batches(cfg, rank, world, steps):
    from trainer_common import CLASSES, IMAGE
    import paddle
    b = cfg["Data"]["batch_size"]
    rng = np.random.RandomState(7)
    out = []
    for _ in range(steps * cfg["Optimizer"]["accumulate_steps"]):
        images = rng.normal(size=(b * world, 3, IMAGE, IMAGE)).astype("float32")
        labels = rng.randint(0, CLASSES, b * world).astype("int64")
        sl = slice(rank * b, (rank + 1) * b)
        out.append((paddle.to_tensor(images[sl]), paddle.to_tensor(labels[sl])))
    return out


def run_case(name, sections, data, out, counter):
    from trainer_common import config
    from plsc.distributed import get_rank, get_world_size
    from plsc.train import Trainer
    from plsc.train.preemption import StopSignals
    sections = {k: dict(v) for k, v in sections.items()}
    sections.setdefault("Model", {}).setdefault("name", "IResNetTiny")
    sections["Data"] = dict(sections.get("Data", {}), batch_size=3)
    cfg = config(data, os.path.join(out, name), **sections)
    trainer = Trainer(cfg)
    rank, world = get_rank(), get_world_size()
    micro = batches(cfg, rank, world, 2)
    a = cfg["Optimizer"]["accumulate_steps"]
    trainer.train_step(micro[:a])  # warm-up: the optimizers' state exists from here on
    counter.calls, counter.on = [], True
    trainer.train_step(micro[a:])
    StopSignals().agree()
    counter.on = False
    trainer.close()
    return counter.calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from plsc.distributed import init
    init()
    counter = Counter()
    report = {name: run_case(name, sections, args.data, args.out, counter)
              for name, sections in CASES.items()}
    report["gloo_groups"] = gloo_group_sums()
    rank_report.write(report)


def gloo_group_sums():
    """Two more gloo groups after the trainers' (all ranks, rank 0 coming late, then all but
    rank 0; Paddle's own new_group refuses the connection here): each all-reduces rank + 1;
    returns the sums this rank saw ([all, rest or None])."""
    import paddle
    from plsc.distributed import all_reduce_, get_rank, get_world_size, gloo_group
    rank, world = get_rank(), get_world_size()
    if rank == 0:  # late, so that the others read its rendezvous key first: over the job's
        time.sleep(1.0)  # store they would find the last group's (connection refused)
    groups = [gloo_group(), gloo_group(range(1, world))]
    sums = []
    for g in groups:
        if rank not in g.ranks:
            sums.append(None)
            continue
        x = paddle.to_tensor([float(rank + 1)])
        all_reduce_(x, "sum", g)
        sums.append(float(x.numpy()[0]))
    return sums


if __name__ == "__main__":
    main()
