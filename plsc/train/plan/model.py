"""A configuration's plan: per-rank memory, the step's collectives and FLOPs, the largest class
count that fits a device profile, and a step time split into compute and communication.

Memory per rank is a sum of named terms (see `memory`): on the "cpu" profile it predicts the
peak resident set (RSS) of a rank, every term a computed size or a measured figure
(`measured`); on a GPU profile it predicts the device memory, with the backbone's activations
from Paddle's allocator (measured in float32, halved with AMP) and a CUDA context assumed.
"""
import copy
import functools
import inspect
from dataclasses import dataclass, field

from . import comm, measured, peer_plan
from .backbone import backbone_cost, forward_flops
from .devices import profile as get_profile
from .head import _probe_head, head_arrays_per_class, head_shape, head_workspace

__all__ = ["Plan", "plan", "memory", "capacity", "fits", "predicted", "step_beyond_gradients"]


@dataclass
class Plan:
    config: dict
    ranks: int
    profile: object
    memory: dict  # term -> bytes, per rank (the largest shard's)
    limit: int  # bytes a rank may take on the profile
    collectives: list
    flops: dict  # backbone, head: FLOPs per step per rank
    seconds: dict  # backbone, head, communication: per step at the datasheet rates
    capacity: int  # largest Loss.num_classes that fits, 0 if none
    head_per_class: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def total(self):
        return sum(self.memory.values())


def recomputes(cfg):
    """Whether the backbone recomputes its blocks' activations: Model.recompute, or when unset
    the named backbone's own choice (arcface_torch's ViT-B, -L and -H do)."""
    m = cfg["Model"]
    if m.get("recompute") is not None:
        return bool(m["recompute"])
    from ...models.registry import MODELS, resolve_name
    return bool(getattr(MODELS[resolve_name(m["name"])], "defaults", {}).get("recompute", False))


class _Context:
    """What does not change with the class count: the probe head, the backbone's cost, the
    measured activations, the head's bytes per class."""

    def __init__(self, cfg, ranks, prof, peer=None):
        self.ranks, self.profile, self.peer = ranks, prof, peer
        amp = cfg["AMP"]
        self.amp = amp["enable"] and prof.gpu
        self.fused = (cfg["Optimizer"]["fused_head_update"]
                      and cfg["Optimizer"]["accumulate_steps"] == 1
                      and not (self.amp and amp["dtype"] == "float16"))
        self.probe = _probe_head(cfg)
        self.per_class = head_arrays_per_class(cfg)
        self.backbone = backbone_cost(cfg)
        m = cfg["Model"]
        self.row = measured.activation_row(m["name"], cfg["Data"]["image_size"], recomputes(cfg))
        self.notes = []

    def at(self, ranks):
        """This context for `ranks` ranks (nothing else in it depends on them, nor on the batch
        size)."""
        out = copy.copy(self)
        out.ranks = int(ranks)
        return out


def step_beyond_gradients(row, figure, batch, gradients, micro_batches, scale=1.0):
    """Bytes a training step holds beyond all the backbone's `gradients` (a term of their
    own), from a measured `row`'s `figure` ("rss" or "alloc") at `batch`, both measured figures
    times `scale`: the larger of the activations beyond the gradients alive beside them
    (`act_*`, measured with the gradients kept) and what the step holds beside all of its
    gradients once they exist (`train_*`, measured as the trainer runs). The trainer frees the
    gradients after each optimizer step (`clear_grad(set_to_zero=False)`): with one
    micro-batch the activations are made without them, so the step peaks at the larger of the
    activations and the gradients (with `train_*`), not their sum; with more, the earlier
    micro-batches' gradients are alive through the later ones' activations, which add."""
    alive = 0 if micro_batches > 1 else gradients
    return max(scale * measured.at_batch(row[f"act_{figure}"], batch) - alive,
               scale * measured.at_batch(row[f"train_{figure}"], batch))


def _activations(cfg, ctx):
    b, row = cfg["Data"]["batch_size"], ctx.row
    step = functools.partial(step_beyond_gradients, row, batch=b,
                             gradients=ctx.backbone.kept()["backbone gradients"],
                             micro_batches=cfg["Optimizer"]["accumulate_steps"])
    if ctx.profile.gpu:
        return {"backbone activations": int(step("alloc", scale=0.5 if ctx.amp else 1.0))}
    out = {"backbone activations": int(step("rss"))}
    if cfg["Eval"]["targets"] and "eval_rss" in row:
        # The trainer gives malloc's kept blocks back before an evaluation, so the evaluation's
        # memory and the step's do not add: the peak is the larger of the two.
        extra = measured.at_batch(row["eval_rss"], cfg["Eval"]["batch_size"]) - out[
            "backbone activations"]
        out["evaluation forward beyond the step's activations"] = max(0, int(extra))
    elif cfg["Eval"]["targets"]:
        ctx.notes.append(f"the evaluation's memory is not measured for {cfg['Model']['name']}: "
                         "left out")
    return out


# Images in insightface's verification packs (two a pair: LFW, CALFW, CPLFW and AgeDB-30 hold
# 6,000 pairs, CFP 7,000 each protocol, VGG2-FP 5,000).
PACK_IMAGES = {"lfw": 12_000, "calfw": 12_000, "cplfw": 12_000, "agedb_30": 12_000,
               "cfp_fp": 14_000, "cfp_ff": 14_000, "vgg2_fp": 10_000}


def _default_pairs():
    from ...data.synthetic import generate
    return inspect.signature(generate).parameters["num_pairs"].default


def _packs(cfg, ctx):
    """The evaluator keeps each target's decoded images (float32 [2P, 3, H, W]) for the run."""
    h, w = cfg["Data"]["image_size"]
    images = 0
    for target in cfg["Eval"]["targets"]:
        if target in PACK_IMAGES:
            images += PACK_IMAGES[target]
        elif cfg["Data"]["dataset"] == "synthetic" and target == "val":
            images += 2 * cfg["Data"]["synthetic"].get("num_pairs", _default_pairs())
        else:
            ctx.notes.append(f"the size of verification pack {target!r} is not known: left out")
    return {"evaluation packs, decoded": images * 3 * h * w * 4} if images else {}


def _loader(cfg):
    d = cfg["Data"]
    h, w = d["image_size"]
    batch = d["batch_size"] * (h * w * 3 + 8)  # uint8 HWC images and int64 labels
    sets = cfg["Optimizer"]["accumulate_steps"] + 3  # the trainer's reused batch tensors
    return {"loader batches": batch * (sets + 2 * d["num_workers"])}  # + workers' slots


def memory(cfg, ctx):
    """{term: bytes} of the rank holding the largest shard: plsc's head, or with `ctx.peer` a
    peer's (arcface_torch's, `peer_plan`) beside the same backbone terms."""
    prof = ctx.profile
    out = {"process (CUDA context)" if prof.gpu else "process": prof.fixed_bytes if prof.gpu
           else measured.PROCESS_RSS}
    if ctx.peer:  # a peer's head, counted from its code: its peak phase (`peer_plan`)
        out.update(peer_plan.head_terms(cfg, ctx, _activations(cfg, ctx)))
        out.update(ctx.backbone.kept())
        out.update(peer_plan.gradient_sum(ctx))
        return out
    shape = head_shape(cfg, ctx.ranks, ctx.fused, ctx.probe)
    for name, per_class in ctx.per_class.items():
        out[f"head {name}"] = int(per_class * shape.num_local)
    for name, nbytes in head_workspace(shape, prof.gpu).items():
        out[f"head step: {name}"] = int(nbytes)
    out.update(ctx.backbone.kept())
    if ctx.ranks > 1:
        out["backbone gradient sum buckets"] = ctx.backbone.gradient_sum()
    out.update(_activations(cfg, ctx))
    if not prof.gpu:
        # rank 0's checkpoint save runs after the step, among the step's freed activations
        # (the trainer gives malloc's kept blocks back only after the save)
        extra = ctx.backbone.save_transient() - out["backbone activations"]
        if extra > 0:
            out["checkpoint save beyond the step's activations"] = int(extra)
        out.update(_loader(cfg))
        out.update(_packs(cfg, ctx))
    return out


def limit(prof, ranks):
    """Bytes one rank may take: a GPU's memory, or the machine's shared by its ranks."""
    if prof.gpu:
        return prof.memory_bytes
    return (prof.memory_bytes - measured.LAUNCHER_RSS) // min(ranks, prof.per_node)


def changed(cfg, section, key, value):
    """A copy of `cfg` with `cfg[section][key] = value`."""
    out = copy.deepcopy(cfg)
    out[section][key] = value
    return out


def with_classes(cfg, num_classes):
    return changed(cfg, "Loss", "num_classes", int(num_classes))


def capacity(cfg, ctx, cap=10 ** 12):
    """The largest Loss.num_classes whose rank fits `limit` (0 when none does)."""
    room = limit(ctx.profile, ctx.ranks)
    fits_ = lambda c: sum(memory(with_classes(cfg, c), ctx).values()) <= room  # noqa: E731
    lo, hi = ctx.ranks - 1, ctx.ranks
    if not fits_(hi):
        return 0
    while hi < cap and fits_(hi):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 10000):  # to 0.01 %
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_(mid) else (lo, mid)
    return lo


def _flops(cfg, ctx, forward):
    b = cfg["Data"]["batch_size"] * cfg["Optimizer"]["accumulate_steps"]
    passes = 4 if recomputes(cfg) else 3
    shape = head_shape(cfg, ctx.ranks, ctx.fused, ctx.probe)
    gemms = 4 if shape.chunk else 3  # the chunked path computes its logits again
    head = 2 * shape.n * shape.rows_used * shape.k * shape.d * gemms
    return {"backbone": passes * forward * b,
            "head": head * cfg["Optimizer"]["accumulate_steps"]}


def _seconds(ctx, flops, collectives):
    prof = ctx.profile
    bb_rate = prof.gemm_flops if ctx.amp or not prof.gpu else prof.fp32_flops
    head_rate = prof.fp32_flops  # the head's GEMMs are float32 whatever the storage
    bw = prof.intra_bw if ctx.ranks <= prof.per_node else prof.inter_bw
    wire = sum(comm.wire_bytes(c, ctx.ranks) for c in collectives)
    return {"backbone": flops["backbone"] / bb_rate, "head": flops["head"] / head_rate,
            "communication": wire / bw}


def plan(cfg, ranks, device="cpu", peer=None):
    """The `Plan` of `cfg` on `ranks` ranks of `device` (a profile name); `peer`: plan a peer's
    head instead of plsc's (`peer_plan.PEERS`)."""
    if int(ranks) < 1:
        raise ValueError(f"--ranks must be >= 1, got {ranks}")
    prof = get_profile(device)
    ctx = _Context(cfg, int(ranks), prof, peer_plan.check(peer, prof))
    mem = memory(cfg, ctx)
    colls = comm.step_collectives(cfg, ctx.ranks, ctx.backbone.buckets,
                                  reduce_scatter=prof.gpu)
    flops = _flops(cfg, ctx, forward_flops(cfg))
    per_class = peer_plan.per_class(cfg, ctx) if ctx.peer else dict(ctx.per_class)
    p = Plan(cfg, ctx.ranks, prof, mem, limit(prof, ctx.ranks), colls, flops,
             _seconds(ctx, flops, colls), capacity(cfg, ctx), per_class)
    if ctx.row.get("scaled_from"):
        p.notes.append(f"activations scaled by the pixels from the {ctx.row['scaled_from']} "
                       "measurement")
    p.notes += sorted(set(ctx.notes))
    p.context = ctx
    return p


def fits(p):
    return p.total <= p.limit


def predicted(cfg, ranks, device, peer=None):
    """(bytes a rank needs, bytes it may take) without the FLOPs and the capacity search."""
    prof = get_profile(device)
    ctx = _Context(cfg, int(ranks), prof, peer)
    return sum(memory(cfg, ctx).values()), limit(prof, int(ranks))
