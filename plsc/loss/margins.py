"""Margins: how the target class's logit is formed.

A margin maps the target cosine `t = cos θ` to the target logit and gives its
derivative; every other class gets `s·cos θ`. The head applies them to the
few target entries only, so these functions work on `[n]` vectors.
"""
import math

import paddle

__all__ = ["Margin", "CombinedMargin", "ArcFace", "CosFace", "SphereFace", "Softmax",
           "MARGINS", "build_margin"]

_SIN_FLOOR = 1e-12


class Margin:
    """Base class. `normalized` says whether logits are cosines (times `scale`)."""

    normalized = True
    scale = 1.0

    def target_logit(self, cos_t):
        raise NotImplementedError

    def target_grad(self, cos_t):
        """d target_logit / d cos_t, as used by the backward pass."""
        raise NotImplementedError


class CombinedMargin(Margin):
    """Target logit `s·(cos(m1·θ + m2) − m3)`; every other logit `s·cos θ`.

    ArcFace is (1, m, 0), CosFace (1, 0, m), SphereFace-style margins m1 > 1.
    By default the gradient is the exact derivative. `straight_through=True`
    gives insightface's variant, which applies the margin without gradient so
    that the target logit's derivative is `s`, as for any other class.
    """

    def __init__(self, s=64.0, m1=1.0, m2=0.0, m3=0.0, straight_through=False):
        for name, v in (("s", s), ("m1", m1), ("m2", m2), ("m3", m3)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"margin parameter {name} must be a finite number, got {v!r}")
        if s <= 0:
            raise ValueError(f"margin scale s must be > 0, got {s}")
        if m1 <= 0:
            raise ValueError(f"margin m1 must be > 0, got {m1}")
        self.scale = float(s)
        self.m1, self.m2, self.m3 = float(m1), float(m2), float(m3)
        self.straight_through = bool(straight_through)

    @property
    def _angular(self):
        return self.m1 != 1.0 or self.m2 != 0.0

    def target_logit(self, cos_t):
        t = paddle.clip(cos_t, -1.0, 1.0)
        if self._angular:
            t = paddle.cos(self.m1 * paddle.acos(t) + self.m2)
        return self.scale * (t - self.m3)

    def target_grad(self, cos_t):
        if self.straight_through or not self._angular:
            return paddle.full_like(cos_t, self.scale)
        t = paddle.clip(cos_t, -1.0, 1.0)
        theta = paddle.acos(t)
        sin_theta = paddle.clip(paddle.sin(theta), min=_SIN_FLOOR)
        return self.scale * self.m1 * paddle.sin(self.m1 * theta + self.m2) / sin_theta

    def __repr__(self):
        return (f"{type(self).__name__}(s={self.scale}, m1={self.m1}, m2={self.m2}, m3={self.m3}"
                f"{', straight_through=True' if self.straight_through else ''})")


class ArcFace(CombinedMargin):
    """Additive angular margin: `s·cos(θ + m)`."""

    def __init__(self, s=64.0, m=0.5, straight_through=False):
        super().__init__(s, 1.0, m, 0.0, straight_through)


class CosFace(CombinedMargin):
    """Additive cosine margin: `s·(cos θ − m)`."""

    def __init__(self, s=64.0, m=0.4):
        super().__init__(s, 1.0, 0.0, m)


class SphereFace(CombinedMargin):
    """Multiplicative angular margin `s·cos(m·θ)` (insightface's combined-margin form).

    Note that `cos(m·θ)` is not monotonic beyond `θ = π/m`; keep m small (≈1.35)."""

    def __init__(self, s=64.0, m=1.35, straight_through=False):
        super().__init__(s, m, 0.0, 0.0, straight_through)


class Softmax(Margin):
    """Plain softmax: logits `x·Wᵀ + b`, no normalisation, no margin (PLSC's dist_softmax)."""

    normalized = False
    scale = 1.0

    def target_logit(self, cos_t):
        return cos_t

    def target_grad(self, cos_t):
        return paddle.ones_like(cos_t)

    def __repr__(self):
        return "Softmax()"


MARGINS = {
    "arcface": ArcFace,
    "cosface": CosFace,
    "sphereface": SphereFace,
    "combined": CombinedMargin,
    "softmax": Softmax,
}


def build_margin(name, **kwargs):
    """Margin by registry name, e.g. `build_margin("arcface", s=64, m=0.5)`."""
    key = str(name).lower()
    if key not in MARGINS:
        raise ValueError(f"unknown margin {name!r}; expected one of {sorted(MARGINS)}")
    return MARGINS[key](**kwargs)
