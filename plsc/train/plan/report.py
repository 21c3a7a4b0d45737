"""The plan as text (tools/plan.py) and the one line of a configuration that does not fit."""
import copy

from . import comm
from .model import predicted

__all__ = ["render", "does_not_fit", "human"]


def human(n):
    """Bytes as B, KiB, MiB, GiB or TiB with 3 significant figures."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024


def _memory_lines(p):
    lines = ["memory per rank (rank 0, the largest shard):"]
    width = max(len(k) for k in p.memory)
    for key, value in p.memory.items():
        lines.append(f"  {key:<{width}}  {human(value):>10}")
    what = "device memory" if p.profile.gpu else "peak RSS"
    lines.append(f"  {'total (' + what + ')':<{width}}  {human(p.total):>10}"
                 f"   of {human(p.limit)} a rank on {p.profile.name}")
    per_class = ", ".join(f"{k} {v:g}" for k, v in p.head_per_class.items())
    lines.append(f"  head arrays per class (B): {per_class}")
    return lines


def _step_lines(p):
    lines = [f"per step ({p.ranks} ranks; payload: what a rank hands over; wire: what it sends "
             f"by a ring):"]
    for c in p.collectives:
        lines.append(f"  {c.name:<52} {c.op:<14} {c.dtype:<8} payload {human(c.payload):>10}"
                     f"  wire {human(comm.wire_bytes(c, p.ranks)):>10}")
    total = sum(c.payload for c in p.collectives)
    lines.append(f"  {'all collectives':<52} {'':<14} {'':<8} payload {human(total):>10}")
    lines.append(f"  FLOPs a rank: backbone {p.flops['backbone']:.3g}, head {p.flops['head']:.3g}")
    s = p.seconds
    lines.append(f"  step time at the profile's rates (a lower bound): compute {s['compute']:.3g} s"
                 f", communication {s['communication']:.3g} s (not overlapped)")
    return lines


def render(p):
    """The plan as lines of text."""
    loss = p.config["Loss"]
    head = (f"plan: {p.config['Model']['name']}, {loss['num_classes']:,} classes "
            f"({loss['param_dtype']} centres), batch {p.config['Data']['batch_size']} a rank, "
            f"{p.ranks} ranks on {p.profile.name}")
    lines = [head] + _memory_lines(p) + _step_lines(p)
    lines.append(f"largest Loss.num_classes that fits: {p.capacity:,}")
    lines.append(f"profile: {p.profile.source}")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def _largest_term(p):
    head = sum(v for k, v in p.memory.items() if k.startswith("head ") and "step" not in k)
    step = sum(v for k, v in p.memory.items() if k.startswith("head step"))
    act = p.memory.get("backbone activations", 0)
    return max([("the head's arrays", head), ("the head's step buffers", step),
                ("the backbone's activations", act)], key=lambda t: t[1])


def _remedies(p):
    """What would make `p` fit, each checked by planning it again."""
    cfg, out = p.config, []
    tries = []
    if cfg["Loss"]["sample_ratio"] >= 1.0:
        tries.append(("Loss.sample_ratio=0.1", ("Loss", "sample_ratio", 0.1)))
    if cfg["Loss"]["param_dtype"] != "int8":
        tries.append(("Loss.param_dtype=int8", ("Loss", "param_dtype", "int8")))
    if not cfg["Model"]["recompute"] and any(s in cfg["Model"]["name"] for s in ("IResNet", "ViT")):
        tries.append(("Model.recompute=true", ("Model", "recompute", True)))
    for text, (sec, key, value) in tries:
        trial = copy.deepcopy(cfg)
        trial[sec][key] = value
        try:
            need, room = predicted(trial, p.ranks, p.profile.name)
        except KeyError:  # e.g. no measured activations with recompute
            continue
        if need <= room:
            out.append(f"{text} (fits)")
        elif need < p.total:
            out.append(f"{text} (saves {human(p.total - need)})")
    need = _ranks_needed(p)
    if need:
        out.append(f"--ranks {need} (fits)")
    return out


def _ranks_needed(p, most=1 << 16):
    k = p.ranks * 2
    while k <= most:
        need, room = predicted(p.config, k, p.profile.name)
        if need <= room:
            return k
        k *= 2
    return None


def does_not_fit(p):
    """One line: what does not fit, by how much, and what would make it fit."""
    what, size = _largest_term(p)
    return (f"does not fit: rank 0 needs {human(p.total)} of {p.profile.name}'s {human(p.limit)} "
            f"a rank ({human(p.total - p.limit)} over; {what} take {human(size)}); would fit with: "
            + ("; ".join(_remedies(p)) or "nothing tried here"))
