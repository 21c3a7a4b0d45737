"""A rank of arcface_torch on a GPU profile: its head counted from its code (`peers`) beside
the backbone as the planner counts it for plsc (`backbone`, `measured`: float32 parameters,
gradients and momentum; activations from Paddle's allocator, halved with AMP; the profile's
assumed CUDA context), and the largest class count that fits. `tools/plan.py --peer`."""
from . import measured, peers
from .backbone import BackboneCost
from .devices import profile as get_profile
from .model import recomputes

__all__ = ["peer_memory", "peer_capacity"]


class _Fixed:
    def __init__(self, cfg, ranks, prof):
        m, data = cfg["Model"], cfg["Data"]
        self.cfg, self.ranks, self.profile = cfg, ranks, prof
        bb = BackboneCost(cfg)
        self.kept = bb.kept()
        # torch DDP (gradient_as_bucket_view=False, its default): a flat float32 copy of the
        # gradients in its buckets
        self.kept["DDP gradient buckets"] = 4 * bb.trainable
        row = measured.activation_row(m["name"], data["image_size"], recomputes(cfg))
        scale = 0.5 if cfg["AMP"]["enable"] else 1.0
        self.activations = int(scale * measured.at_batch(row["train_alloc"], data["batch_size"]))
        n, d = data["batch_size"] * ranks, m["embedding_size"]
        self.features = 3 * 4 * n * d  # gathered features, their gradient, the local slice


def peer_memory(cfg, ranks, device, version, optimizer=None, fixed=None):
    """{term: bytes} of arcface_torch `version` on the rank with the most classes; the peak is
    the larger of the head's backward (the backbone's activations alive) and its optimizer
    step (activations freed)."""
    prof = get_profile(device)
    fixed = fixed or _Fixed(cfg, ranks, prof)
    loss, data = cfg["Loss"], cfg["Data"]
    num_local = -(-loss["num_classes"] // ranks)
    optimizer = optimizer or cfg["Optimizer"]["name"]
    phases = peers.head_phases(version, num_local, cfg["Model"]["embedding_size"],
                               loss["sample_ratio"], data["batch_size"] * ranks, ranks, optimizer)
    best = None
    for phase, arrays in phases.items():
        out = {"process (CUDA context)": prof.fixed_bytes}
        out.update(fixed.kept)
        out["features and their gradient"] = fixed.features
        if phase == "backward":
            out["backbone activations"] = fixed.activations
        out.update({f"head ({phase}) {k}": v for k, v in arrays.items()})
        if best is None or sum(out.values()) > sum(best.values()):
            best = out
    return best


def peer_capacity(cfg, ranks, device, version, optimizer=None):
    """The largest Loss.num_classes whose rank fits the profile's memory (0: none)."""
    import copy
    prof = get_profile(device)
    fixed = _Fixed(cfg, ranks, prof)

    def fits(c):
        trial = copy.deepcopy(cfg)
        trial["Loss"]["num_classes"] = int(c)
        return sum(peer_memory(trial, ranks, device, version, optimizer, fixed).values()) \
            <= prof.memory_bytes
    lo, hi = 0, ranks
    if not fits(hi):
        return 0
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 10000):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
