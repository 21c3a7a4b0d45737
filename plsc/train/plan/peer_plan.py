"""A peer's head in the planner's own path (`model.memory` with `peer`, `tools/plan.py --peer`):
arcface_torch's head counted from its code (`peers`) in place of plsc's, beside the backbone as
the planner counts it for plsc (`backbone`, `measured`: float32 parameters, gradients and
momentum; activations from Paddle's allocator, halved with AMP; the profile's assumed CUDA
context), torch DDP's gradient buckets in place of plsc's gradient sum, and the same capacity
search (`model.capacity`). GPU profiles only (the peer's tables are GPU memory)."""
from . import peers

__all__ = ["PEERS", "check", "head_terms", "gradient_sum", "per_class"]

PEERS = {"arcface_torch_v1": "v1", "arcface_torch_v2": "v2"}


def check(peer, prof):
    """`peer` when it can be planned on profile `prof`; ValueError naming the choices."""
    if peer is None:
        return None
    if peer not in PEERS:
        raise ValueError(f"--peer {peer!r}: choose one of {', '.join(PEERS)}")
    if not prof.gpu:
        raise ValueError(f"--peer {peer}: a GPU --device (its memory tables are a GPU's)")
    return peer


def _phases(cfg, ctx, num_local):
    loss, data = cfg["Loss"], cfg["Data"]
    return peers.head_phases(PEERS[ctx.peer], num_local, cfg["Model"]["embedding_size"],
                             loss["sample_ratio"], data["batch_size"] * ctx.ranks, ctx.ranks,
                             cfg["Optimizer"]["name"])


def head_terms(cfg, ctx, activations):
    """{term: bytes} of the peer's head on the rank with the most classes, at its larger phase:
    the head's backward (`activations`, the backbone's, alive) or its optimizer step (freed)."""
    num_local = -(-cfg["Loss"]["num_classes"] // ctx.ranks)
    n, d = cfg["Data"]["batch_size"] * ctx.ranks, cfg["Model"]["embedding_size"]
    best = None
    for phase, arrays in _phases(cfg, ctx, num_local).items():
        out = {f"head ({phase}) {k}": v for k, v in arrays.items()}
        out["features and their gradient"] = 3 * 4 * n * d  # gathered, gradient, local slice
        if phase == "backward":
            out.update(activations)
        if best is None or sum(out.values()) > sum(best.values()):
            best = out
    return best


def gradient_sum(ctx):
    """torch DDP (gradient_as_bucket_view=False, its default): a flat float32 copy of the
    gradients in its buckets."""
    return {"DDP gradient buckets": 4 * ctx.backbone.trainable} if ctx.ranks > 1 else {}


def per_class(cfg, ctx):
    """{peer head: bytes per class of the rank at its peak phase}."""
    loss, data = cfg["Loss"], cfg["Data"]
    return {ctx.peer: peers.per_class_bytes(PEERS[ctx.peer], cfg["Model"]["embedding_size"],
                                            loss["sample_ratio"], data["batch_size"] * ctx.ranks,
                                            ctx.ranks, cfg["Optimizer"]["name"])}
