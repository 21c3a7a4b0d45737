"""Margins: how the target class's logit is formed.

A margin maps the target cosine `t = cos θ` to the target logit and gives its
derivative; every other class gets `s·cos θ` (clamped to `s·[−cos_clip, cos_clip]` when the
margin sets `cos_clip`). The head applies them to the few target entries only, so these
functions work on `[n]` vectors, one entry per sample of the gathered batch.

A margin that depends on the sample (AdaFace reads image quality off the feature norm) gives
the head a per-batch margin: `margin.for_batch(norms)` is called once per forward with the
`[n]` feature norms of the gathered batch; the others return themselves.
"""
import math

import paddle
from paddle import nn

from ..kernels.numerics import sqrt_exact
from .table import MARGIN_TABLE

__all__ = ["Margin", "CombinedMargin", "ArcFace", "CosFace", "SphereFace", "AdaFace", "Softmax",
           "MARGINS", "build_margin"]

_SIN_FLOOR = 1e-12


class Margin:
    """Base class. `normalized` says whether logits are cosines (times `scale`); `cos_clip`,
    when set, clamps every cosine to [−cos_clip, cos_clip] (zero gradient outside)."""

    normalized = True
    scale = 1.0
    cos_clip = None

    def for_batch(self, norms):
        """The margin for a batch whose gathered feature norms are `norms` (`[n]` float32)."""
        return self

    def target_logit(self, cos_t):
        """The target classes' logits for their cosines `cos_t` (`[n]`)."""
        raise NotImplementedError

    def target_grad(self, cos_t):
        """d target_logit / d cos_t, as used by the backward pass."""
        raise NotImplementedError


def _check_numbers(**params):
    for name, v in params.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"margin parameter {name} must be a finite number, got {v!r}")
    if params["s"] <= 0:
        raise ValueError(f"margin scale s must be > 0, got {params['s']}")


def _inside(x, lo, hi):
    """1.0 where lo <= x <= hi, else 0.0: the derivative of clip(x, lo, hi)."""
    return paddle.logical_and(x >= lo, x <= hi).astype(x.dtype)


class CombinedMargin(Margin):
    """Target logit `s·(cos(m1·θ + m2) − m3)`; every other logit `s·cos θ`.

    ArcFace is (1, m, 0), CosFace (1, 0, m), SphereFace-style margins m1 > 1.
    By default the gradient is the exact derivative. `straight_through=True`
    gives insightface's variant, which applies the margin without gradient so
    that the target logit's derivative is `s`, as for any other class.
    """

    def __init__(self, s=64.0, m1=1.0, m2=0.0, m3=0.0, straight_through=False):
        _check_numbers(s=s, m1=m1, m2=m2, m3=m3)
        if m1 <= 0:
            raise ValueError(f"margin m1 must be > 0, got {m1}")
        self.scale = float(s)
        self.m1, self.m2, self.m3 = float(m1), float(m2), float(m3)
        self.straight_through = bool(straight_through)

    @property
    def _angular(self):
        return self.m1 != 1.0 or self.m2 != 0.0

    def target_logit(self, cos_t):
        """`s·(cos(m1·θ + m2) − m3)` with `θ = acos(cos_t)`, `cos_t` clipped to [−1, 1]."""
        t = paddle.clip(cos_t, -1.0, 1.0)
        if self._angular:
            t = paddle.cos(self.m1 * paddle.acos(t) + self.m2)
        return self.scale * (t - self.m3)

    def target_grad(self, cos_t):
        """d target_logit / d cos_t: `s·m1·sin(m1·θ + m2) / sin θ` (sin θ floored at 1e-12);
        `s` when the margin is not angular (m1 = 1, m2 = 0) or `straight_through`."""
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


class AdaFace(nn.Layer, Margin):
    """AdaFace (Kim et al., CVPR 2022): the margin adapts to image quality, read off the
    feature norm.

    Per sample, the norm ‖x‖ clipped to [0.001, 100] is standardised with running batch
    statistics, `q = clip(h·(‖x‖ − batch_mean) / (batch_std + 1e-3), −1, 1)` (no gradient);
    the target angle becomes `clip(θ − m·q, 1e-3, π − 1e-3)` and its cosine is lowered by
    `m + m·q`; every cosine is first clamped to [−1 + 1e-3, 1 − 1e-3]. In training mode each
    batch first updates `batch_mean` and `batch_std` (buffers, initially 20 and 100) as
    `t_alpha·batch + (1 − t_alpha)·running`, the batch std unbiased. In the head the batch is
    the gathered global batch, so every rank uses the same values. A Layer, so that the head's
    `train()` / `eval()` and `state_dict()` cover it.
    """

    eps = 1e-3
    cos_clip = 1.0 - 1e-3

    def __init__(self, s=64.0, m=0.4, h=0.333, t_alpha=0.01):
        nn.Layer.__init__(self)
        _check_numbers(s=s, m=m, h=h, t_alpha=t_alpha)
        if not 0.0 <= t_alpha <= 1.0:
            raise ValueError(f"AdaFace t_alpha must be in [0, 1], got {t_alpha}")
        self.scale, self.m, self.h, self.t_alpha = float(s), float(m), float(h), float(t_alpha)
        self.register_buffer("batch_mean", paddle.full([], 20.0, "float32"))
        self.register_buffer("batch_std", paddle.full([], 100.0, "float32"))

    def for_batch(self, norms):
        """The margin of this batch, from its gathered feature norms `norms` (`[n]`); in
        training mode it first updates `batch_mean` and `batch_std` (ValueError below 2
        samples)."""
        norms = paddle.clip(norms.detach().astype("float32"), 0.001, 100.0)
        if self.training:
            if norms.shape[0] < 2:
                raise ValueError("AdaFace needs a global batch of at least 2 samples (the "
                                 f"batch std is unbiased), got {norms.shape[0]}")
            with paddle.no_grad():
                a, mean = self.t_alpha, norms.mean()
                std = sqrt_exact(paddle.square(norms - mean).sum() / (norms.shape[0] - 1))
                paddle.assign(mean * a + (1.0 - a) * self.batch_mean, self.batch_mean)
                paddle.assign(std * a + (1.0 - a) * self.batch_std, self.batch_std)
        q = paddle.clip((norms - self.batch_mean) / (self.batch_std + self.eps) * self.h,
                        -1.0, 1.0)
        return _AdaFaceBatch(self, q)

    def target_logit(self, cos_t):
        """RuntimeError: AdaFace's logits depend on the batch; use `for_batch(norms)`'s."""
        raise RuntimeError("AdaFace depends on the batch: use margin.for_batch(norms)")

    target_grad = target_logit
    """RuntimeError, as `target_logit`."""

    def extra_repr(self):
        """The margin's parameters, as `repr(margin)` shows them."""
        return f"s={self.scale}, m={self.m}, h={self.h}, t_alpha={self.t_alpha}"


class _AdaFaceBatch(Margin):
    """AdaFace with the quality indicator `q` (`[n]`) of one batch."""

    def __init__(self, ada, q):
        self.scale, self.cos_clip, self.m, self.eps = ada.scale, ada.cos_clip, ada.m, ada.eps
        self.q = q

    def _angles(self, cos_t):
        c = paddle.clip(cos_t, -self.cos_clip, self.cos_clip)
        theta = paddle.acos(c)
        return c, theta, theta - self.m * self.q

    def target_logit(self, cos_t):
        _, _, shifted = self._angles(cos_t)
        angle = paddle.clip(shifted, self.eps, math.pi - self.eps)
        return self.scale * (paddle.cos(angle) - (self.m + self.m * self.q))

    def target_grad(self, cos_t):
        c, theta, shifted = self._angles(cos_t)
        angle = paddle.clip(shifted, self.eps, math.pi - self.eps)
        inside = _inside(cos_t, -self.cos_clip, self.cos_clip) * \
            _inside(shifted, self.eps, math.pi - self.eps)
        return self.scale * inside * paddle.sin(angle) / paddle.sin(theta)


class Softmax(Margin):
    """Plain softmax: logits `x·Wᵀ + b`, no normalisation, no margin (PLSC's dist_softmax)."""

    normalized = False
    scale = 1.0

    def target_logit(self, cos_t):
        """The logit itself (`x·w + b`, passed as `cos_t`), unchanged."""
        return cos_t

    def target_grad(self, cos_t):
        """1 for every entry."""
        return paddle.ones_like(cos_t)

    def __repr__(self):
        return "Softmax()"


def _registry():
    """{name: class} of the margins' table (`table.py`: names, config keys, normalised or not),
    each row's class found here by its name and checked to agree on `normalized`."""
    registry = {}
    for row in MARGIN_TABLE:
        cls = globals().get(row.class_name)
        if not (isinstance(cls, type) and issubclass(cls, Margin)) or \
                cls.normalized != row.normalized:
            raise TypeError(f"margin table row {row.name!r}: {row.class_name} must be a Margin "
                            f"of this module with normalized={row.normalized}")
        registry[row.name] = cls
    return registry


MARGINS = _registry()
"""{config name: margin class}, one entry per row of `MARGIN_TABLE` (`Loss.margin` values)."""


def build_margin(name, **kwargs):
    """Margin by registry name (a row of `plsc.loss.table`) with its constructor's keywords."""
    key = str(name).lower()
    if key not in MARGINS:
        raise ValueError(f"unknown margin {name!r}; expected one of {sorted(MARGINS)}")
    return MARGINS[key](**kwargs)
