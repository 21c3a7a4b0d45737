"""Face-recognition backbones: IResNet, MobileFaceNet, face ViTs (embedding only; the margin
head lives in `plsc.nn`).

    from plsc.models import build_model
    backbone = build_model("IResNet50", embedding_size=512, input_size=(112, 112))
    embeddings = backbone(images)          # [B, 3, 112, 112] -> [B, 512]

insightface's arcface_torch weights in and out (`insightface.py`):

    backbone = from_insightface("r50", "backbone.pth")   # embedding size from the weights
    to_insightface(backbone, "model.pt", name="r50")     # arcface_torch's get_model("r50") loads it

The names (`MODEL_NAMES`, `ALIASES`, `resolve_name`) come from `names`, without Paddle (the
config checks `Model.name` at load); everything else imports Paddle on first use.
"""
from .names import ALIASES, MODEL_NAMES, resolve_name

# attribute -> the submodule that defines it, imported on first use
_LAZY = {
    **dict.fromkeys(("IBasicBlock", "IResNet", "iresnet18", "iresnet34", "iresnet50",
                     "iresnet100", "iresnet200", "iresnet_tiny"), "iresnet"),
    "set_unbiased_var": "batchnorm",
    "count_parameters": "layers",
    **dict.fromkeys(("from_insightface", "insightface_layout", "insightface_to_plsc",
                     "plsc_to_insightface", "to_insightface"), "insightface"),
    **dict.fromkeys(("MobileFaceNet", "mobilefacenet_large"), "mobilefacenet"),
    **dict.fromkeys(("MODELS", "build_model", "model_options"), "registry"),
    "VisionTransformer": "vit",
}

__all__ = [
    "ALIASES", "MODELS", "MODEL_NAMES", "build_model", "model_options", "resolve_name",
    "count_parameters", "IBasicBlock", "IResNet", "iresnet18", "iresnet34", "iresnet50",
    "iresnet100", "iresnet200", "iresnet_tiny", "MobileFaceNet", "mobilefacenet_large",
    "VisionTransformer", "from_insightface", "to_insightface", "insightface_to_plsc",
    "plsc_to_insightface", "insightface_layout", "set_unbiased_var",
]


def __getattr__(name):  # `from plsc.models import build_model` imports Paddle, `.names` not
    if name in _LAZY:
        import importlib
        value = globals()[name] = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        return value
    raise AttributeError(f"module 'plsc.models' has no attribute {name!r}")
