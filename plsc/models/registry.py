"""Backbones by name: `build_model("IResNet50", embedding_size=512)`."""
import difflib

from .iresnet import iresnet18, iresnet34, iresnet50, iresnet100, iresnet200, iresnet_tiny
from .mobilefacenet import MobileFaceNet, mobilefacenet_large

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
}

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


def build_model(name, **kwargs):
    """Build the backbone registered under `name` with constructor `kwargs`.

    Common kwargs: `embedding_size=512`, `input_size=(112, 112)`, `dropout=0.0`.
    """
    return MODELS[resolve_name(name)](**kwargs)
