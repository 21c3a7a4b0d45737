"""The collectives of one training step and the bytes each moves, from the head's shapes and the
gradient sum's bucket layout.

A `Collective`'s `payload` is what one rank hands to the collective: an all-reduce's or a
reduce-scatter's tensor, an all-gather's input (the bytes of that rank's share). `wire` is what
one rank sends over the interconnect by a ring (all-reduce 2(k-1)/k of the tensor, reduce-scatter
(k-1)/k, all-gather k-1 shares), which the step time uses. Backends without reduce-scatter
(gloo) run the features' gradient as an all-reduce of the whole `[N, d]` and keep their slice;
gloo's float16 sum is an all-gather of the float16 payloads (`plsc.distributed.start_sum`).
"""
from dataclasses import dataclass

__all__ = ["Collective", "step_collectives", "wire_bytes"]

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8}


@dataclass(frozen=True)
class Collective:
    name: str
    op: str  # all_reduce, all_gather, reduce_scatter
    dtype: str
    payload: int  # bytes one rank hands over


def wire_bytes(c, ranks):
    """Bytes one rank sends for `c` by a ring on `ranks` ranks."""
    if ranks == 1:
        return 0
    if c.op == "all_reduce":
        return 2 * (ranks - 1) * c.payload // ranks
    if c.op == "reduce_scatter":
        return (ranks - 1) * c.payload // ranks
    return (ranks - 1) * c.payload


def step_collectives(cfg, ranks, bucket_sizes, reduce_scatter=True):
    """The collectives of one optimizer step on `ranks` ranks (in the order they run, for each
    micro-batch, then the gradient sum and the stop agreement), for a backend with
    (`reduce_scatter`: NCCL) or without (gloo) reduce-scatter. `bucket_sizes`: the
    gradient sum's buckets in elements (`BackboneCost.buckets`)."""
    if ranks == 1:
        return []
    b, d = cfg["Data"]["batch_size"], cfg["Model"]["embedding_size"]
    n = b * ranks
    head = [Collective("labels all-gather", "all_gather", "int64", 8 * b),
            Collective("features all-gather", "all_gather", "float32", 4 * b * d),
            Collective("softmax max all-reduce", "all_reduce", "float32", 4 * n),
            Collective("softmax sum all-reduce", "all_reduce", "float32", 4 * n),
            Collective("loss all-reduce", "all_reduce", "float32", 4 * n)]
    if reduce_scatter:
        head.append(Collective("features gradient reduce-scatter", "reduce_scatter", "float32",
                               4 * n * d))
    else:
        head.append(Collective("features gradient all-reduce (no reduce-scatter)",
                               "all_reduce", "float32", 4 * n * d))
    out = head * cfg["Optimizer"]["accumulate_steps"]
    wire = cfg["Optimizer"]["grad_allreduce_dtype"]
    op = "all_gather" if wire == "float16" and not reduce_scatter else "all_reduce"
    for i, size in enumerate(bucket_sizes):
        out.append(Collective(f"backbone gradient bucket {i + 1}", op, wire, _BYTES[wire] * size))
    out.append(Collective("step checks all-reduce", "all_reduce", "float32", 4))
    out.append(Collective("stop agreement all-reduce", "all_reduce", "float32", 8))
    return out
