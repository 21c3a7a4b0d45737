"""Face-recognition backbones: IResNet, MobileFaceNet, face ViTs (embedding only; the margin
head lives in `plsc.nn`).

    from plsc.models import build_model
    backbone = build_model("IResNet50", embedding_size=512, input_size=(112, 112))
    embeddings = backbone(images)          # [B, 3, 112, 112] -> [B, 512]

insightface's arcface_torch weights in and out (`insightface.py`):

    backbone = from_insightface("r50", "backbone.pth")   # embedding size from the weights
    to_insightface(backbone, "model.pt", name="r50")     # arcface_torch's get_model("r50") loads it
"""
from .iresnet import (IBasicBlock, IResNet, iresnet18, iresnet34, iresnet50, iresnet100, iresnet200,
                      iresnet_tiny)
from .batchnorm import set_unbiased_var
from .layers import count_parameters
from .insightface import (from_insightface, insightface_layout, insightface_to_plsc,
                          plsc_to_insightface, to_insightface)
from .mobilefacenet import MobileFaceNet, mobilefacenet_large
from .registry import ALIASES, MODELS, build_model, model_options, resolve_name
from .vit import VisionTransformer

__all__ = [
    "ALIASES", "MODELS", "build_model", "model_options", "resolve_name", "count_parameters",
    "IBasicBlock", "IResNet", "iresnet18", "iresnet34", "iresnet50", "iresnet100", "iresnet200",
    "iresnet_tiny", "MobileFaceNet", "mobilefacenet_large", "VisionTransformer",
    "from_insightface", "to_insightface", "insightface_to_plsc", "plsc_to_insightface",
    "insightface_layout", "set_unbiased_var",
]
