"""Margin formulas and their derivatives against autograd and the closed forms."""
import math

import numpy as np
import paddle
import pytest

from oracles import PUBLISHED
from plsc.loss import ArcFace, CombinedMargin, CosFace, Softmax, SphereFace, build_margin

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets

COS = np.linspace(-0.95, 0.95, 39)


def autograd_derivative(fn, cos):
    t = paddle.to_tensor(cos, dtype="float64")
    t.stop_gradient = False
    fn(t).sum().backward()
    return t.grad.numpy()


@pytest.mark.parametrize("m1,m2,m3", [(1.0, 0.5, 0.0), (1.0, 0.0, 0.35), (1.35, 0.0, 0.0),
                                      (1.2, 0.3, 0.1)])
def test_combined_margin_value_and_exact_gradient(m1, m2, m3):
    margin = CombinedMargin(30.0, m1, m2, m3)
    t = paddle.to_tensor(COS, dtype="float64")
    expect = 30.0 * (np.cos(m1 * np.arccos(COS) + m2) - m3)
    np.testing.assert_allclose(margin.target_logit(t).numpy(), expect, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(margin.target_grad(t).numpy(),
                               autograd_derivative(margin.target_logit, COS), rtol=1e-9)


def test_named_margins_are_their_combined_forms():
    t = paddle.to_tensor(COS, dtype="float64")
    for named, (m1, m2, m3) in [(ArcFace(64, 0.5), (1, 0.5, 0)), (CosFace(64, 0.4), (1, 0, 0.4)),
                                (SphereFace(64, 1.35), (1.35, 0, 0))]:
        expect = 64 * (np.cos(m1 * np.arccos(COS) + m2) - m3)
        np.testing.assert_allclose(named.target_logit(t).numpy(), expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_defaults_are_the_published_parameters(name):
    """ArcFace(), CosFace(), SphereFace() with no arguments: the target logit and the scale
    of the other logits are those of the published (s, m1, m2, m3) (tests/oracles.py, written
    from arcface_torch and insightface, not from plsc)."""
    p = PUBLISHED[name]
    margin = {"ArcFace": ArcFace, "CosFace": CosFace, "SphereFace": SphereFace}[name]()
    t = paddle.to_tensor(COS, dtype="float64")
    expect = p["s"] * (np.cos(p["m1"] * np.arccos(COS) + p["m2"]) - p["m3"])
    np.testing.assert_allclose(margin.target_logit(t).numpy(), expect, rtol=1e-12, atol=1e-12)
    assert margin.scale == p["s"] and margin.normalized and not margin.straight_through


def test_straight_through_gradient_is_the_scale():
    margin = ArcFace(64.0, 0.5, straight_through=True)
    t = paddle.to_tensor(COS, dtype="float64")
    np.testing.assert_array_equal(margin.target_grad(t).numpy(), np.full(len(COS), 64.0))


def test_softmax_is_identity_without_normalisation():
    m = Softmax()
    assert not m.normalized
    t = paddle.to_tensor(COS)
    np.testing.assert_array_equal(m.target_logit(t).numpy(), t.numpy())


def test_registry_and_bad_parameters():
    assert isinstance(build_margin("ArcFace", s=32.0, m=0.3), ArcFace)
    with pytest.raises(ValueError, match="unknown margin 'arc'"):
        build_margin("arc")
    with pytest.raises(ValueError, match="scale s must be > 0"):
        CosFace(s=0.0)
    with pytest.raises(ValueError, match="m2 must be a finite number"):
        CombinedMargin(64.0, 1.0, math.nan, 0.0)
