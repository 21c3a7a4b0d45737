"""Backbones by name: `build_model("IResNet50", embedding_size=512)`."""
from .iresnet import OPTIONS as IRESNET_OPTIONS
from .iresnet import iresnet18, iresnet34, iresnet50, iresnet100, iresnet200, iresnet_tiny
from .mobilefacenet import MobileFaceNet, mobilefacenet_large
from ..names import ALIASES, MODEL_NAMES, resolve_name
from .vit import (VIT_OPTIONS, vit_b, vit_b_dp005_mask005, vit_demo, vit_h, vit_l_dp005_mask005,
                  vit_s, vit_s_dp005_mask0, vit_t, vit_t_dp005_mask0)

__all__ = ["MODELS", "ALIASES", "OPTIONS", "resolve_name", "model_options", "build_model"]

_CONSTRUCTORS = {build.__name__: build for build in (
    iresnet18, iresnet34, iresnet50, iresnet100, iresnet200, iresnet_tiny, MobileFaceNet,
    mobilefacenet_large, vit_t, vit_t_dp005_mask0, vit_s, vit_s_dp005_mask0, vit_b,
    vit_b_dp005_mask005, vit_l_dp005_mask005, vit_h, vit_demo)}

# Canonical name -> constructor taking keyword arguments; the names and aliases are spelled in
# `plsc.names` (MODEL_NAMES: canonical name -> constructor name), which the config reads.
MODELS = {name: _CONSTRUCTORS[function] for name, function in MODEL_NAMES.items()}

# Constructor settings only some backbones have (the ViTs' `VIT_OPTIONS`, IResNet's recompute):
# a constructor lists those it takes in its `options` attribute.
OPTIONS = tuple(dict.fromkeys(VIT_OPTIONS + IRESNET_OPTIONS))


def model_options(name):
    """The `OPTIONS` (e.g. `drop_path_rate`, `mask_ratio`, `patch_size`, `recompute`) that the
    backbone `name` takes."""
    return tuple(getattr(MODELS[resolve_name(name)], "options", ()))


def build_model(name, **kwargs):
    """Build the backbone registered under `name` with constructor `kwargs`.

    Common kwargs: `embedding_size=512`, `input_size=(112, 112)`, `dropout=0.0`. The ViTs
    also take `drop_path_rate`, `mask_ratio`, `patch_size` and `recompute` (None: the name's
    value), IResNets `recompute`; for another backbone such a key must be absent or None, else
    ValueError names it.
    """
    canonical = resolve_name(name)
    build = MODELS[canonical]
    for key in OPTIONS:
        if key in kwargs and key not in getattr(build, "options", ()):
            if kwargs[key] is not None:
                raise ValueError(f"{canonical} has no {key} (it has "
                                 f"{', '.join(getattr(build, 'options', ())) or 'no options'}), "
                                 f"got {key}={kwargs[key]!r}; leave it unset")
            del kwargs[key]
    return build(**kwargs)
