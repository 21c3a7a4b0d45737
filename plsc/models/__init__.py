"""Face-recognition backbones: IResNet, MobileFaceNet, face ViTs (embedding only; the margin
head lives in `plsc.nn`).

    from plsc.models import build_model
    backbone = build_model("IResNet50", embedding_size=512, input_size=(112, 112))
    embeddings = backbone(images)          # [B, 3, 112, 112] -> [B, 512]
"""
from .iresnet import (IBasicBlock, IResNet, iresnet18, iresnet34, iresnet50, iresnet100, iresnet200,
                      iresnet_tiny)
from .layers import count_parameters
from .mobilefacenet import MobileFaceNet, mobilefacenet_large
from .registry import ALIASES, MODELS, build_model, model_options, resolve_name
from .vit import VisionTransformer

__all__ = [
    "ALIASES", "MODELS", "build_model", "model_options", "resolve_name", "count_parameters",
    "IBasicBlock", "IResNet", "iresnet18", "iresnet34", "iresnet50", "iresnet100", "iresnet200",
    "iresnet_tiny", "MobileFaceNet", "mobilefacenet_large", "VisionTransformer",
]
