"""The plan as data (`figures`, tools/plan.py --json), as text from that data alone (`render`), and
the one line of a configuration that does not fit."""
from . import comm, speed
from .fixes import fixes

__all__ = ["figures", "render", "does_not_fit", "human"]


def human(n):
    """Bytes as B, KiB, MiB, GiB or TiB with 3 significant figures."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024


def figures(p, images=None):
    """Every figure of the plan as plain data (`tools/plan.py --json`); `render` reads only
    these. `images`: the training set's size (default: `speed.dataset_images`)."""
    loss, cfg = p.config["Loss"], p.config
    out = {"model": cfg["Model"]["name"], "num_classes": loss["num_classes"],
           "param_dtype": loss["param_dtype"], "sample_ratio": loss["sample_ratio"],
           "batch_size": cfg["Data"]["batch_size"],
           "ranks": p.ranks, "device": p.profile.name, "gpu": p.profile.gpu,
           "memory": dict(p.memory), "total": p.total, "limit": p.limit, "fits": p.total <= p.limit,
           "head_per_class": dict(p.head_per_class),
           "collectives": [{"name": c.name, "op": c.op, "dtype": c.dtype, "payload": c.payload,
                            "wire": comm.wire_bytes(c, p.ranks)} for c in p.collectives],
           "flops": dict(p.flops), "datasheet_seconds": dict(p.seconds),
           "speed": speed.speed(p, images), "capacity": p.capacity,
           "profile_source": p.profile.source, "notes": list(p.notes)}
    bound = speed.head_bound_at_capacity(p)
    out["head_bound_at_capacity"] = ({"head_flops": bound[0], "backbone_flops": bound[1],
                                      "ratio": bound[0] / bound[1]} if bound else None)
    return out


def _memory_lines(f):
    lines = ["memory per rank (rank 0, the largest shard):"]
    width = max(len(k) for k in f["memory"])
    for key, value in f["memory"].items():
        lines.append(f"  {key:<{width}}  {human(value):>10}")
    what = "device memory" if f["gpu"] else "peak RSS"
    lines.append(f"  {'total (' + what + ')':<{width}}  {human(f['total']):>10}"
                 f"   of {human(f['limit'])} a rank on {f['device']}")
    per_class = ", ".join(f"{k} {v:g}" for k, v in f["head_per_class"].items())
    lines.append(f"  head arrays per class (B): {per_class}")
    return lines


def _step_lines(f):
    lines = [f"per step ({f['ranks']} ranks; payload: what a rank hands over; wire: what it sends "
             f"by a ring):"]
    for c in f["collectives"]:
        lines.append(f"  {c['name']:<52} {c['op']:<14} {c['dtype']:<8} payload "
                     f"{human(c['payload']):>10}  wire {human(c['wire']):>10}")
    total = sum(c["payload"] for c in f["collectives"])
    lines.append(f"  {'all collectives':<52} {'':<14} {'':<8} payload {human(total):>10}")
    lines.append(f"  FLOPs a rank: backbone {f['flops']['backbone']:.3g}, head {f['flops']['head']:.3g}")
    return lines


def _duration(seconds):
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _speed_lines(f):
    s = f["speed"]
    terms = ", ".join(f"{k} {1000 * v:.3g} ms" for k, v in s["terms_s"].items())
    if s["error"] is None:
        how = "this machine's measured rates, not calibrated"
    elif s["calibrated"]:
        how = ("datasheet rates x efficiency factors fitted to published throughputs of IResNets "
               f"on 8 x V100, within +/-{100 * s['error']:.0f} % of them")
    else:
        how = ("datasheet rates x efficiency factors fitted to IResNets on 8 x V100; this run is "
               "outside that and its error is not bounded: an upper bound, see docs/scaling.md")
    lines = [f"speed ({how}):",
             f"  step {1000 * s['step_s']:.3g} ms ({terms}); bound: {s['bound']}",
             f"  images/s: {s['images_per_s']:,.0f} over {f['ranks']} ranks"]
    if "epoch_s" in s:
        lines.append(f"  epoch of {s['dataset']} ({s['dataset_images']:,} images): "
                     f"{_duration(s['epoch_s'])}")
    else:
        lines.append("  epoch: the training set's size is not known (--images N gives it)")
    return lines


def render(f):
    """The plan's `figures` as lines of text."""
    head = (f"plan: {f['model']}, {f['num_classes']:,} classes ({f['param_dtype']} centres), "
            f"batch {f['batch_size']} a rank, {f['ranks']} ranks on {f['device']}")
    lines = [head] + _memory_lines(f) + _step_lines(f) + _speed_lines(f)
    lines.append(f"largest Loss.num_classes that fits: {f['capacity']:,}")
    hb = f["head_bound_at_capacity"]
    if hb:
        lines.append(f"warning: at {f['capacity']:,} classes the step is head-bound: head FLOPs "
                     f"{hb['head_flops']:.3g}, {hb['ratio']:.3g} x "
                     f"the backbone's {hb['backbone_flops']:.3g}"
                     + (" (Partial FC, Loss.sample_ratio below 1, cuts them)"
                        if f["sample_ratio"] >= 1 else ""))
    lines.append(f"profile: {f['profile_source']}")
    lines += [f"note: {n}" for n in f["notes"]]
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
