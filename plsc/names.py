"""Names a user picks from a list, without Paddle (the config checks them at load, before
Paddle loads):

- the backbones' names, the one place they are spelled: each canonical name with its
  constructor's name in `plsc.models` (its registry maps one to the other), and insightface's
  arcface_torch names (`get_model`) as aliases; `resolve_name`;
- the "did you mean" hint of every such name (config keys and sections, model names, choices,
  kernel sets): `closest`, `did_you_mean`.
"""
import difflib

__all__ = ["MODEL_NAMES", "ALIASES", "resolve_name", "closest", "did_you_mean"]

# Canonical name -> the constructor's name.
MODEL_NAMES = {
    "IResNet18": "iresnet18",
    "IResNet34": "iresnet34",
    "IResNet50": "iresnet50",
    "IResNet100": "iresnet100",
    "IResNet200": "iresnet200",
    "IResNetTiny": "iresnet_tiny",
    "MobileFaceNet": "MobileFaceNet",
    "MobileFaceNetLarge": "mobilefacenet_large",
    "ViT_T": "vit_t",
    "ViT_T_DP005_Mask0": "vit_t_dp005_mask0",
    "ViT_S": "vit_s",
    "ViT_S_DP005_Mask0": "vit_s_dp005_mask0",
    "ViT_B": "vit_b",
    "ViT_B_DP005_Mask005": "vit_b_dp005_mask005",
    "ViT_L_DP005_Mask005": "vit_l_dp005_mask005",
    "ViT_H": "vit_h",
    "ViTDemo": "vit_demo",
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

_BY_LOWER_NAME = {name.lower(): name for name in MODEL_NAMES}
_BY_LOWER_NAME.update({alias.lower(): name for alias, name in ALIASES.items()})


def resolve_name(name):
    """Canonical model name for `name` (any case, or an insightface alias).

    Raises ValueError naming the unknown value and the closest valid name.
    """
    canonical = _BY_LOWER_NAME.get(str(name).lower())
    if canonical is not None:
        return canonical
    hint = did_you_mean(name, _BY_LOWER_NAME, cutoff=0.0, listed=False, shown=_BY_LOWER_NAME)
    raise ValueError(f"unknown model {name!r}{hint} Valid names: {', '.join(MODEL_NAMES)} "
                     f"(aliases: {', '.join(ALIASES)}; case-insensitive).")


def closest(name, options, cutoff=0.5):
    """The option most like `name` (compared in lower case), or None below `cutoff`."""
    by_lower = {str(option).lower(): option for option in options}
    close = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=cutoff)
    return by_lower[close[0]] if close else None


def did_you_mean(name, options, cutoff=0.5, listed=True, shown=None):
    """"; did you mean 'X'?" for the option closest to `name` (`shown[X]` in its place when
    given), else "; valid: a, b, c" ("" when `listed` is False: the caller lists them)."""
    close = closest(name, options, cutoff)
    if close is not None:
        return f"; did you mean {(shown or {}).get(close, close)!r}?"
    return f"; valid: {', '.join(options)}" if listed else ""
