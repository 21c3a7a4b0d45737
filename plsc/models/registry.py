"""Backbones by name: `build_model("IResNet50", embedding_size=512)`."""
import difflib

from .iresnet import OPTIONS as IRESNET_OPTIONS
from .iresnet import iresnet18, iresnet34, iresnet50, iresnet100, iresnet200, iresnet_tiny
from .mobilefacenet import MobileFaceNet, mobilefacenet_large
from .vit import (VIT_OPTIONS, vit_b, vit_b_dp005_mask005, vit_demo, vit_h, vit_l_dp005_mask005,
                  vit_s, vit_s_dp005_mask0, vit_t, vit_t_dp005_mask0)

# Canonical name -> constructor taking keyword arguments.
MODELS = {
    "IResNet18": iresnet18,
    "IResNet34": iresnet34,
    "IResNet50": iresnet50,
    "IResNet100": iresnet100,
    "IResNet200": iresnet200,
    "IResNetTiny": iresnet_tiny,
    "MobileFaceNet": MobileFaceNet,
    "MobileFaceNetLarge": mobilefacenet_large,
    "ViT_T": vit_t,
    "ViT_T_DP005_Mask0": vit_t_dp005_mask0,
    "ViT_S": vit_s,
    "ViT_S_DP005_Mask0": vit_s_dp005_mask0,
    "ViT_B": vit_b,
    "ViT_B_DP005_Mask005": vit_b_dp005_mask005,
    "ViT_L_DP005_Mask005": vit_l_dp005_mask005,
    "ViT_H": vit_h,
    "ViTDemo": vit_demo,
}

# insightface's arcface_torch names (`get_model`) -> canonical names.
ALIASES = {
    "r18": "IResNet18",
    "r34": "IResNet34",
    "r50": "IResNet50",
    "r100": "IResNet100",
    "r200": "IResNet200",
    "mbf": "MobileFaceNet",
    "mbf_large": "MobileFaceNetLarge",
    "vit_t": "ViT_T",
    "vit_t_dp005_mask0": "ViT_T_DP005_Mask0",
    "vit_s": "ViT_S",
    "vit_s_dp005_mask_0": "ViT_S_DP005_Mask0",
    "vit_b": "ViT_B",
    "vit_b_dp005_mask_005": "ViT_B_DP005_Mask005",
    "vit_l_dp005_mask_005": "ViT_L_DP005_Mask005",
    "vit_h": "ViT_H",
}

# Constructor settings only some backbones have (the ViTs' `VIT_OPTIONS`, IResNet's recompute):
# a constructor lists those it takes in its `options` attribute.
OPTIONS = tuple(dict.fromkeys(VIT_OPTIONS + IRESNET_OPTIONS))

_BY_LOWER_NAME = {name.lower(): name for name in MODELS}
_BY_LOWER_NAME.update({alias.lower(): name for alias, name in ALIASES.items()})


def resolve_name(name):
    """Canonical model name for `name` (any case, or an insightface alias).

    Raises ValueError naming the unknown value and the closest valid name.
    """
    canonical = _BY_LOWER_NAME.get(str(name).lower())
    if canonical is not None:
        return canonical
    close = difflib.get_close_matches(str(name).lower(), list(_BY_LOWER_NAME), n=1, cutoff=0.0)
    hint = f"; did you mean {_BY_LOWER_NAME[close[0]]!r}?" if close else ""
    raise ValueError(f"unknown model {name!r}{hint} Valid names: {', '.join(MODELS)} "
                     f"(aliases: {', '.join(ALIASES)}; case-insensitive).")


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
