"""Images a second, time per epoch and the bound of a step, from the plan's FLOPs and wire bytes
at the profile's datasheet rates scaled by efficiency factors fitted to published throughputs.

A step takes backbone + head + communication seconds (not overlapped): the backbone's FLOPs at
the 16-bit rate (AMP) or the float32 rate, each times 1 / its efficiency; the head's float32
GEMMs at the float32 rate / `head` efficiency; the wire bytes at the link's bandwidth (no
factor: no published run here is bound by communication, so none can be fitted), plus a fixed
overhead a step. The factors
are the least-squares fit (relative error) of `CALIBRATION`'s runs, all 8 x V100 SXM2 32 GB;
`HELD_OUT` were not used. `fit` recomputes them (benchmarks/calibrate_speed.py prints the
table, docs/scaling.md shows it); a GPU profile other than the V100 uses the same fractions of
its own datasheet (an assumption). The cpu profile's rates were measured here: factor 1.
"""
from dataclasses import dataclass

__all__ = ["EFFICIENCY", "ERROR", "CALIBRATION", "HELD_OUT", "Published", "DATASETS",
           "dataset_images", "step_terms", "speed", "head_bound_at_capacity", "fit"]


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
_MS1MV2 = ("Loss.num_classes=85742", "Loss.sample_ratio=1.0")
_3M = ("Loss.num_classes=3000000", "Data.batch_size=128", "AMP.enable=true")
CALIBRATION = (
    Published("IResNet50, MS1MV2, 128 a GPU, fp16", "configs/arcface_r50.yaml",
              _MS1MV2 + ("Data.batch_size=128", "AMP.enable=true"), 8, "v100-32gb", 5102, _PFC),
    Published("IResNet50, MS1MV2, 64 a GPU, fp16", "configs/arcface_r50.yaml",
              _MS1MV2 + ("Data.batch_size=64", "AMP.enable=true"), 8, "v100-32gb", 3770, _PFC),
    Published("IResNet50, MS1MV2, 128 a GPU, fp32", "configs/arcface_r50.yaml",
              _MS1MV2 + ("Data.batch_size=128", "AMP.enable=false"), 8, "v100-32gb", 2833, _PFC),
    Published("IResNet50, MS1MV2, 64 a GPU, fp32", "configs/arcface_r50.yaml",
              _MS1MV2 + ("Data.batch_size=64", "AMP.enable=false"), 8, "v100-32gb", 2745, _PFC),
    Published("IResNet50, 3M classes, full softmax, 128 a GPU, AMP", "configs/arcface_r50.yaml",
              _3M + ("Loss.sample_ratio=1.0",), 8, "v100-32gb", 2270, _ARC),
)
HELD_OUT = (
    Published("IResNet100, MS1MV2, 128 a GPU, fp16", "configs/cosface_r100.yaml",
              _MS1MV2 + ("Data.batch_size=128", "AMP.enable=true"), 8, "v100-32gb", 3337, _PFC),
    Published("IResNet100, MS1MV2, 128 a GPU, fp32", "configs/cosface_r100.yaml",
              _MS1MV2 + ("Data.batch_size=128", "AMP.enable=false"), 8, "v100-32gb", 1800, _PFC),
    Published("IResNet50, 3M classes, Partial FC 0.1, 128 a GPU, AMP", "configs/arcface_r50.yaml",
              _3M + ("Loss.sample_ratio=0.1",), 8, "v100-32gb", 5300, _ARC),
)

# Fitted by `fit(CALIBRATION)` (tests/test_plan_speed.py checks they still are): the fraction
# of the datasheet rate a step reaches, and a fixed time a step (launches, the loader, the
# optimizer's element-wise kernels; the 64- and 128-image rows differ by it). The float32
# backbone's factor is above 1: cuDNN's 3 x 3 convolutions (Winograd, FFT) do fewer multiplies
# than the direct count the FLOPs are.
EFFICIENCY = {"backbone_16bit": 0.2647, "backbone_float32": 1.099, "head": 0.2989,
              "step_overhead_s": 0.05227}
# The largest |error| of the fitted model over CALIBRATION and HELD_OUT (docs/scaling.md).
ERROR = 0.15

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


def step_terms(p, efficiency=None):
    """{backbone, head, communication}: seconds of a step of plan `p` at the calibrated rates."""
    s = p.seconds
    if not p.profile.gpu:
        return dict(s)
    e = efficiency or EFFICIENCY
    bb = e["backbone_16bit"] if p.context.amp else e["backbone_float32"]
    return {"backbone": s["backbone"] / bb, "head": s["head"] / e["head"],
            "communication": s["communication"], "overhead": e["step_overhead_s"]}


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
           "error": ERROR if p.profile.gpu else None}
    data = ("given", images) if images else dataset_images(cfg)
    if data and out["images_per_s"]:
        out["dataset"], out["dataset_images"] = data
        out["epoch_s"] = data[1] / out["images_per_s"]
    return out


def fit(plans_and_published):
    """EFFICIENCY fitted to [(plan, images/s published)]: the inverse efficiencies minimise the
    sum of squared relative errors of the step time (a linear least squares)."""
    import numpy as np
    keys = ("backbone_16bit", "backbone_float32", "head", "step_overhead_s")
    rows, rhs = [], []
    for p, published in plans_and_published:
        cfg = p.config
        t = cfg["Data"]["batch_size"] * cfg["Optimizer"]["accumulate_steps"] * p.ranks / published
        s = p.seconds
        row = [s["backbone"] if p.context.amp else 0.0, 0.0 if p.context.amp else s["backbone"],
               s["head"], 1.0]
        rows.append([x / t for x in row])
        rhs.append(1.0 - s["communication"] / t)
    inv = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0]
    out = {k: float(1.0 / v) for k, v in zip(keys[:3], inv)}
    out["step_overhead_s"] = float(inv[3])
    return out


def head_bound_at_capacity(p):
    """(head FLOPs, backbone FLOPs) of a step at the plan's capacity when the head's are the
    larger (the largest class count that fits is then head-bound), else None."""
    from .backbone import forward_flops
    from .model import _flops, with_classes
    if not p.capacity:
        return None
    f = _flops(with_classes(p.config, p.capacity), p.context, forward_flops(p.config))
    return (f["head"], f["backbone"]) if f["head"] > f["backbone"] else None
