"""Margins for the classification head."""
from .margins import (MARGINS, AdaFace, ArcFace, CombinedMargin, CosFace, Margin, Softmax,
                      SphereFace, build_margin)

__all__ = ["Margin", "CombinedMargin", "ArcFace", "CosFace", "SphereFace", "AdaFace", "Softmax",
           "MARGINS", "build_margin"]
