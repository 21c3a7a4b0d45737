"""Margins for the classification head."""
from .margins import (MARGINS, ArcFace, CombinedMargin, CosFace, Margin, Softmax, SphereFace,
                      build_margin)

__all__ = ["Margin", "CombinedMargin", "ArcFace", "CosFace", "SphereFace", "Softmax",
           "MARGINS", "build_margin"]
