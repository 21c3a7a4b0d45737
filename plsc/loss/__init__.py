"""Margins for the classification head: their classes (`margins`, which import Paddle) and
their table (`table`: names, config keys, normalised or not; no Paddle import, so that the
config schema reads it before Paddle loads). The classes are imported on first use."""
from .table import MARGIN_TABLE, margin_row

_FROM_MARGINS = ("Margin", "CombinedMargin", "ArcFace", "CosFace", "SphereFace", "AdaFace",
                 "Softmax", "MARGINS", "build_margin")

__all__ = [*_FROM_MARGINS, "MARGIN_TABLE", "margin_row"]


def __getattr__(name):  # `from plsc.loss import ArcFace` imports Paddle, `import plsc.loss` not
    if name in _FROM_MARGINS:
        from . import margins
        return getattr(margins, name)
    raise AttributeError(f"module 'plsc.loss' has no attribute {name!r}")
