"""What would make a configuration that does not fit fit, each found by planning it again
(`report.does_not_fit` says them in one line): a change of the head or the backbone (Partial FC,
int8 centres, recompute), the largest `Data.batch_size` that fits, and more ranks, by a search
that stops where more ranks cannot help:

- "shared": the ranks share one machine's memory (the cpu profile): a further rank divides only
  the head's arrays and adds its own process, backbone and activations, so what the ranks need
  in all grows while each one's share shrinks; fewer ranks are tried instead;
- "kept": from k to 2k ranks what rank 0 needs did not drop, or the terms that did not shrink
  (activations, the backbone's state, the CUDA context; the gathered features grow with the
  ranks) already exceed the device;
- "classes": `Loss.num_classes` cannot be split over 2k ranks (`ClassPartition`: every rank owns
  a class).
"""
from dataclasses import dataclass, field

from .model import changed, limit, memory, predicted, recomputes

__all__ = ["Fix", "Stop", "fixes", "rank_search", "largest_batch"]


@dataclass
class Fix:
    text: str  # what to pass: "Data.batch_size=850", "--ranks 16"
    need: int  # bytes rank 0 needs with it
    room: int  # bytes a rank may take with it
    saves: int  # bytes less than without it (negative: more, e.g. fewer ranks of a machine)

    @property
    def fits(self):
        return self.need <= self.room


@dataclass
class Stop:
    """Where and why the search for more ranks stopped without a fit."""
    why: str  # "shared", "kept" or "classes" (see the module's docstring)
    ranks: int  # the rank count it stopped at
    need: int = 0  # bytes rank 0 needs there (0: "classes", not plannable)
    room: int = 0  # bytes a rank may take there
    kept: dict = field(default_factory=dict)  # "kept": the terms that did not shrink to `ranks`
    before: int = 0  # "shared": bytes the machine's ranks need in all at the ranks asked for


def _needs(cfg, ctx):
    mem = memory(cfg, ctx)
    return mem, sum(mem.values()), limit(ctx.profile, ctx.ranks)


def _splits(num_classes, ranks):
    from ...distributed import ClassPartition
    try:
        ClassPartition(num_classes, ranks)
    except ValueError:
        return False
    return True


def rank_search(p):
    """(a rank count that fits or None, the `Stop` or None) for plan `p` that does not fit: on a
    profile whose ranks share a machine the most ranks below `p.ranks` (halving) that fit, and
    the "shared" stop; else the fewest above it (doubling) that fit, or where that stopped."""
    cfg, ctx = p.config, p.context
    mem, need, room = _needs(cfg, ctx)
    if limit(p.profile, 2 * p.ranks) < room:  # one machine's memory, shared
        k = p.ranks // 2
        while k >= 1 and _needs(cfg, ctx.at(k))[1] > limit(p.profile, k):
            k //= 2
        _, need2, room2 = _needs(cfg, ctx.at(2 * p.ranks))
        stop = Stop("shared", 2 * p.ranks, need2, room2, before=need * p.ranks)
        return (k if k >= 1 else None), stop
    k = p.ranks
    while True:
        if not _splits(cfg["Loss"]["num_classes"], 2 * k):
            return None, Stop("classes", 2 * k)
        mem2, need2, room2 = _needs(cfg, ctx.at(2 * k))
        if need2 <= room2:
            return 2 * k, None
        kept = {t: v for t, v in mem2.items() if v > 0 and v >= mem.get(t, 0)}
        if need2 >= need or sum(kept.values()) > room2:
            return None, Stop("kept", 2 * k, need2, room2, kept)
        k, mem, need = 2 * k, mem2, need2


def largest_batch(p):
    """The largest `Data.batch_size` below the config's that fits `p.ranks` (None if not even
    1 does): a bisection, what a rank needs growing with the batch."""
    cfg, ctx = p.config, p.context
    fits = lambda b: _needs(changed(cfg, "Data", "batch_size", b), ctx)[1] <= p.limit  # noqa: E731
    if not fits(1):
        return None
    lo, hi = 1, cfg["Data"]["batch_size"]  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _changes(cfg):
    loss, model = cfg["Loss"], cfg["Model"]
    if loss["sample_ratio"] >= 1.0:
        yield "Loss", "sample_ratio", 0.1
    if loss["param_dtype"] != "int8":
        yield "Loss", "param_dtype", "int8"
    if not recomputes(cfg) and any(s in model["name"] for s in ("IResNet", "ViT")):
        yield "Model", "recompute", True


def _text(section, key, value):
    return f"{section}.{key}={str(value).lower() if isinstance(value, bool) else value}"


def fixes(p):
    """([`Fix`], `Stop` or None) for plan `p` that does not fit: each change planned again
    (kept when it fits or saves memory), the largest batch size that fits, the rank count that
    fits (or where and why the search for one stopped)."""
    out = []
    for section, key, value in _changes(p.config):
        try:
            need, room = predicted(changed(p.config, section, key, value), p.ranks,
                                   p.profile.name, p.context.peer)
        except KeyError:  # e.g. no measured activations with recompute
            continue
        if need < p.total:
            out.append(Fix(_text(section, key, value), need, room, p.total - need))
    batch = largest_batch(p)
    if batch:
        cfg = changed(p.config, "Data", "batch_size", batch)
        out.append(_fix(p, _text("Data", "batch_size", batch), cfg, p.context))
    ranks, stop = rank_search(p)
    if ranks:
        out.append(_fix(p, f"--ranks {ranks}", p.config, p.context.at(ranks)))
    return out, stop


def _fix(p, text, cfg, ctx):
    _, need, room = _needs(cfg, ctx)
    return Fix(text, need, room, p.total - need)
