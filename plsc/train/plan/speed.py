"""Images a second, time per epoch and the bound of a step, from the plan's FLOPs and wire bytes
at the profile's datasheet rates scaled by efficiency factors fitted to published throughputs.

A step takes backbone + head + communication seconds (not overlapped): the backbone's FLOPs at
the 16-bit rate (AMP) or the float32 rate, each times 1 / its efficiency; the head's float32
GEMMs at the float32 rate / `head` efficiency; the wire bytes at the link's bandwidth (no
factor: no published run here is bound by communication, so none can be fitted), plus Partial
FC's draw over the rank's classes and a fixed overhead a step. The factors
are the least-squares fit (relative error) of `CALIBRATION`'s runs, all 8 x V100 SXM2 32 GB;
`HELD_OUT` were not used. `fit` recomputes them (benchmarks/calibrate_speed.py prints the
table, docs/scaling.md shows it); a GPU profile other than the V100 uses the same fractions of
its own datasheet (an assumption). The cpu profile's rates were measured here: factor 1.
"""
from dataclasses import dataclass

__all__ = ["EFFICIENCY", "ERROR", "CALIBRATION", "HELD_OUT", "Published", "DATASETS",
           "dataset_images", "step_terms", "calibrated", "speed", "head_bound_at_capacity", "fit"]


@dataclass(frozen=True)
class Published:
    label: str
    config: str
    overrides: tuple
    ranks: int
    device: str
    images_per_s: float
    source: str


_PFC = "deepinsight/insightface recognition/partial_fc/pytorch/README.md (8 x V100-SXM2-32GB)"
_ARC = "deepinsight/insightface recognition/arcface_torch/docs/speed_benchmark.md (8 x V100-SXM2-32GB)"
_TABLE = ("deepinsight/insightface recognition/arcface_torch/README.md, Speed Benchmark table 1 "
          "(8 x V100 32GB, IResNet50, 128 a GPU, AMP)")
_MS1MV2 = ("Loss.num_classes=85742", "Loss.sample_ratio=1.0")
_R50 = "configs/arcface_r50.yaml"
_AMP128 = ("Data.batch_size=128", "AMP.enable=true")


def _table(classes, ratio, images_per_s):
    how = "model parallel" if ratio == 1 else f"Partial FC {ratio}"
    return Published(f"IResNet50, {classes:,} classes, {how}, 128 a GPU, AMP", _R50,
                     (f"Loss.num_classes={classes}", f"Loss.sample_ratio={ratio}") + _AMP128, 8,
                     "v100-32gb", images_per_s, _TABLE)


CALIBRATION = (
    Published("IResNet50, MS1MV2, 128 a GPU, fp16", _R50, _MS1MV2 + _AMP128, 8, "v100-32gb",
              5102, _PFC),
    Published("IResNet50, MS1MV2, 64 a GPU, fp16", _R50,
              _MS1MV2 + ("Data.batch_size=64", "AMP.enable=true"), 8, "v100-32gb", 3770, _PFC),
    Published("IResNet50, MS1MV2, 128 a GPU, fp32", _R50,
              _MS1MV2 + ("Data.batch_size=128", "AMP.enable=false"), 8, "v100-32gb", 2833, _PFC),
    Published("IResNet50, MS1MV2, 64 a GPU, fp32", _R50,
              _MS1MV2 + ("Data.batch_size=64", "AMP.enable=false"), 8, "v100-32gb", 2745, _PFC),
    _table(1_400_000, 1.0, 3043),
    _table(5_500_000, 1.0, 1389),
    _table(1_400_000, 0.1, 4738),
    _table(29_000_000, 0.1, 1855),
)
HELD_OUT = (
    Published("IResNet100, MS1MV2, 128 a GPU, fp16", "configs/cosface_r100.yaml",
              _MS1MV2 + _AMP128, 8, "v100-32gb", 3337, _PFC),
    Published("IResNet100, MS1MV2, 128 a GPU, fp32", "configs/cosface_r100.yaml",
              _MS1MV2 + ("Data.batch_size=128", "AMP.enable=false"), 8, "v100-32gb", 1800, _PFC),
    _table(125_000, 1.0, 4824),
    _table(125_000, 0.1, 5004),
    _table(5_500_000, 0.1, 3975),
    _table(8_000_000, 0.1, 3565),
    _table(16_000_000, 0.1, 2679),
    Published("IResNet50, 3M classes, model parallel, 128 a GPU, AMP", _R50,
              ("Loss.num_classes=3000000", "Loss.sample_ratio=1.0") + _AMP128, 8, "v100-32gb",
              2270, _ARC),
    Published("IResNet50, 3M classes, Partial FC 0.1, 128 a GPU, AMP", _R50,
              ("Loss.num_classes=3000000", "Loss.sample_ratio=0.1") + _AMP128, 8, "v100-32gb",
              5300, _ARC),
)

# Fitted by `fit(CALIBRATION)` (tests/test_plan_speed.py checks they still are): the fraction
# of the datasheet rate a step reaches; Partial FC's draw, seconds a class of the rank (its
# random keys and top-k over every class of the shard, and the sampled rows' gather and
# scatter: not FLOPs, so not in the GEMMs' time; 35 ns a class, the 29M row's 0.13 s); a fixed
# time a step (launches, the loader, the optimizer's element-wise kernels: the 64- and
# 128-image rows differ by it). The float32 backbone's factor is above 1: cuDNN's 3 x 3
# convolutions (Winograd, FFT) do fewer multiplies than the direct count the FLOPs are.
EFFICIENCY = {"backbone_16bit": 0.2528, "backbone_float32": 1.081, "head": 0.3299,
              "draw_s_per_class": 3.49e-08, "step_overhead_s": 0.04953}
# The largest |error| of the fitted model over CALIBRATION and HELD_OUT (docs/scaling.md),
# rounded up to a whole per cent.
ERROR = 0.20

# Published training-set sizes by their class count (ids, images): PaddlePaddle/PLSC
# task/recognition/face/README.md (MS1MV2 85k ids / 5.8M, MS1MV3 93k / 5.2M, Glint360K 360k /
# 17.1M, WebFace42M 2M / 42.5M); WebFace4M and WebFace12M: the WebFace260M paper (Zhu et al.,
# CVPR 2021), 205,990 ids / 4.2M and 617,970 / 12.7M; configs/wf12m_conflict_r50_pfc03_filter04.yaml
# names 1,017,970 classes over WebFace12M's 12,720,066 images.
DATASETS = {85742: ("MS1MV2", 5_800_000), 93431: ("MS1MV3", 5_200_000),
            360232: ("Glint360K", 17_100_000), 2059906: ("WebFace42M", 42_500_000),
            205990: ("WebFace4M", 4_200_000), 617970: ("WebFace12M", 12_700_000),
            1017970: ("WebFace12M (conflict ids)", 12_720_066)}


def dataset_images(cfg):
    """(name, images) of the config's training set: a synthetic set's own count, else the
    published set with Loss.num_classes classes; None when not known."""
    d = cfg["Data"]
    if d["dataset"] == "synthetic":
        from ...data.synthetic import generate
        import inspect
        defaults = {k: v.default for k, v in inspect.signature(generate).parameters.items()}
        s = dict(defaults, **d.get("synthetic", {}))
        return "synthetic", s["num_identities"] * s["images_per_identity"]
    return DATASETS.get(cfg["Loss"]["num_classes"])


def _draw_classes(p):
    """Classes of the rank Partial FC draws from each step (0 with the full softmax)."""
    loss = p.config["Loss"]
    if loss["sample_ratio"] >= 1:
        return 0
    return -(-loss["num_classes"] // p.ranks) * p.config["Optimizer"]["accumulate_steps"]


def step_terms(p, efficiency=None):
    """{backbone, head, communication, overhead}: seconds of a step of plan `p` at the
    calibrated rates (the head's: its GEMMs and Partial FC's draw over the rank's classes)."""
    s = p.seconds
    if not p.profile.gpu:
        return dict(s)
    e = efficiency or EFFICIENCY
    bb = e["backbone_16bit"] if p.context.amp else e["backbone_float32"]
    return {"backbone": s["backbone"] / bb,
            "head": s["head"] / e["head"] + e["draw_s_per_class"] * _draw_classes(p),
            "communication": s["communication"], "overhead": e["step_overhead_s"]}


def calibrated(p):
    """Whether plan `p` is of the kind the factors were fitted on: an IResNet on one node of
    V100s (elsewhere the error is not bounded: docs/scaling.md)."""
    return (p.profile.name == "v100-32gb" and p.ranks <= p.profile.per_node
            and p.config["Model"]["name"].startswith("IResNet"))


_BOUND = {"backbone": "backbone compute", "head": "head compute", "communication": "communication",
          "overhead": "per-step overhead"}


def speed(p, images=None, efficiency=None):
    """The plan's speed: step seconds by term, the bound, images/s, the error band and, for a
    training set of `images` (default: `dataset_images`), the seconds of an epoch."""
    terms = step_terms(p, efficiency)
    step = sum(terms.values())
    cfg = p.config
    per_step = cfg["Data"]["batch_size"] * cfg["Optimizer"]["accumulate_steps"] * p.ranks
    out = {"step_s": step, "terms_s": terms, "bound": _BOUND[max(terms, key=terms.get)],
           "images_per_s": per_step / step if step else 0.0,
           "error": ERROR if p.profile.gpu else None, "calibrated": calibrated(p)}
    data = ("given", images) if images else dataset_images(cfg)
    if data and out["images_per_s"]:
        out["dataset"], out["dataset_images"] = data
        out["epoch_s"] = data[1] / out["images_per_s"]
    return out


def fit(plans_and_published):
    """EFFICIENCY fitted to [(plan, images/s published)]: the inverse efficiencies, the draw's
    seconds a class and the overhead minimise the sum of squared relative errors of the step
    time (a linear least squares)."""
    import numpy as np
    rows, rhs = [], []
    for p, published in plans_and_published:
        cfg = p.config
        t = cfg["Data"]["batch_size"] * cfg["Optimizer"]["accumulate_steps"] * p.ranks / published
        s, amp = p.seconds, p.context.amp
        row = [s["backbone"] if amp else 0.0, 0.0 if amp else s["backbone"], s["head"],
               _draw_classes(p), 1.0]
        rows.append([x / t for x in row])
        rhs.append(1.0 - s["communication"] / t)
    x = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0]
    return {"backbone_16bit": float(1 / x[0]), "backbone_float32": float(1 / x[1]),
            "head": float(1 / x[2]), "draw_s_per_class": float(x[3]),
            "step_overhead_s": float(x[4])}


def head_bound_at_capacity(p):
    """(head FLOPs, backbone FLOPs) of a step at the plan's capacity when the head's are the
    larger (the largest class count that fits is then head-bound), else None."""
    from .backbone import forward_flops
    from .model import _flops, with_classes
    if not p.capacity:
        return None
    f = _flops(with_classes(p.config, p.capacity), p.context, forward_flops(p.config))
    return (f["head"], f["backbone"]) if f["head"] > f["backbone"] else None
