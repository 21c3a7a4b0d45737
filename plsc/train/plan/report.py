"""The plan as text (tools/plan.py) and the one line of a configuration that does not fit."""
from . import comm
from .fixes import fixes

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


def _fix(f):
    if f.fits:
        return f"{f.text} (fits: needs {human(f.need)} of {human(f.room)})"
    return f"{f.text} (saves {human(f.saves)})"


def _stop(p, s):
    """Why more ranks cannot help, from a `fixes.Stop`."""
    if s.why == "shared":
        return (f"more ranks cannot help: the ranks share this machine's {human(p.limit * p.ranks)}"
                f" ({p.ranks} need {human(s.before)} in all, {s.ranks} would need "
                f"{human(s.need * s.ranks)})")
    if s.why == "classes":
        return (f"more ranks cannot help: {p.config['Loss']['num_classes']:,} classes cannot be "
                f"split over {s.ranks} ranks (each rank must own one)")
    term, size = max(s.kept.items(), key=lambda t: t[1])
    return (f"more ranks cannot help: at {s.ranks} ranks rank 0 still needs {human(s.need)} of "
            f"{human(s.room)}, {human(sum(s.kept.values()))} of it in terms that do not shrink "
            f"with more ranks (the largest: {term} {human(size)})")


def does_not_fit(p):
    """One line: what does not fit, by how much, what would make it fit (each change planned
    again, `fixes`), why more ranks would not, and what saves memory without fitting."""
    what, size = _largest_term(p)
    found, stop = fixes(p)
    fitting = [_fix(f) for f in found if f.fits]
    parts = [f"does not fit: rank 0 needs {human(p.total)} of {p.profile.name}'s "
             f"{human(p.limit)} a rank ({human(p.total - p.limit)} over; {what} take "
             f"{human(size)}); would fit with: " + ("; ".join(fitting) or "none of the changes tried")]
    if stop:
        parts.append(_stop(p, stop))
    less = [_fix(f) for f in found if not f.fits]
    if less:
        parts.append("saves memory, does not fit alone: " + ", ".join(less))
    return "; ".join(parts)
