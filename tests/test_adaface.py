"""AdaFace in one process against the float64 dense oracle (tests/oracles.py: written from
the AdaFace reference code's formulas), on data that hits every clamp, and the oracle itself
checked against finite differences and the combined margin it reduces to."""
import math

import numpy as np
import paddle
import pytest

from head_cases.adaface_subcenters import (adaface_stats, check_adaface_clamps,
                                           check_adaface_steps, set_adaface_stats)
from head_cases.common import run_head_step
from head_cases.fused import check_fused_vs_separate, fused_failures
from oracles import (ADA_CLAMP_STATS, AdaFaceOracle, adaface_clamp_hits, compare_oracle,
                     dense_reference, make_adaface_case, make_case, make_subcenter_case,
                     finite_difference_grads, oracle_reference, rel_err, row_rel_err)
from plsc.loss import ArcFace, CombinedMargin, CosFace

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets


def AdaFace(**kw):  # noqa: N802
    from plsc.loss import AdaFace as cls
    return cls(**kw)


def assert_errs(errs):
    for key, (err, allowed) in errs.items():
        assert err <= allowed, (key, err, allowed)


# ---- the oracle


def test_oracle_statistics_by_hand():
    x = np.zeros((4, 3), dtype="float32")
    x[:, 0] = [1e-5, 3.0, 4.0, 250.0]  # norms clamped to 0.001 and 100
    o = AdaFaceOracle(h=0.5, t_alpha=0.1).update(x)
    n = np.array([0.001, 3.0, 4.0, 100.0])
    mean = n.sum() / 4
    std = math.sqrt(((n - mean) ** 2).sum() / 3)
    assert o.batch_mean == pytest.approx(0.1 * mean + 0.9 * 20.0, rel=1e-12)
    assert o.batch_std == pytest.approx(0.1 * std + 0.9 * 100.0, rel=1e-12)
    raw = 0.5 * (n - o.batch_mean) / (o.batch_std + 1e-3)
    np.testing.assert_allclose(o.q(x), np.clip(raw, -1, 1), rtol=1e-12)


@pytest.mark.parametrize("q", [0.0, 0.3, -0.6])
def test_oracle_with_one_q_is_a_combined_margin(q):
    """Without clamps, a q shared by all samples makes AdaFace the combined margin
    s·(cos(θ − m·q) − (m + m·q)): ArcFace's angle shift, then CosFace's subtraction."""
    s, m = 64.0, 0.4
    x, y, w, _ = make_case(seed=11, n=10, d=16, num_classes=13, margin=CosFace(s, m))
    o = AdaFaceOracle(s=s, m=m)
    assert not any(adaface_clamp_hits(x, y, w, _fixed_q(o, q)).values())
    got = oracle_reference(x, y, w, o, q=np.full(10, q))
    ref = dense_reference(x, y, w, CombinedMargin(s, 1.0, -m * q, m + m * q))
    for key in ("loss", "dx", "dw"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-9, atol=1e-12)


def _fixed_q(oracle, q):
    class Fixed(AdaFaceOracle):
        def raw_q(self, x):
            return np.full(len(x), q)
    f = Fixed(oracle.s, oracle.m)
    return f


def test_oracle_gradients_match_finite_differences():
    """On the clamp data (every clamp hit, no value near a bound), q fixed."""
    x, y, w, _ = make_adaface_case(seed=2, n=10, d=5, num_classes=4)
    o = AdaFaceOracle(s=8.0, m=0.4, **ADA_CLAMP_STATS).update(x)
    hits = adaface_clamp_hits(x, y, w, o)
    assert all(v > 0 for key, v in hits.items() if key != "norm_below"), hits
    q = o.q(x)
    ref = oracle_reference(x, y, w, o, q=q)
    num = finite_difference_grads(lambda xv, wv: oracle_reference(xv, y, wv, o, q=q)["loss"], x, w)
    for key in ("dx", "dw"):
        np.testing.assert_allclose(ref[key], num[key], rtol=1e-5,
                                   atol=1e-6 * np.abs(num[key]).max())


def test_oracle_clamped_entries_have_no_gradient():
    """Targets whose cosine or angle is clamped: the target logit has zero derivative."""
    x, y, w, roles = make_adaface_case(seed=3, n=10, d=16, num_classes=8)
    o = AdaFaceOracle(s=8.0, m=0.4, **ADA_CLAMP_STATS).update(x)
    xt = paddle.to_tensor(x.astype("float64"))
    xt.stop_gradient = False
    from oracles import oracle_logits
    logits = oracle_logits(xt, paddle.to_tensor(w.astype("float64")), y, o, q=o.q(x))
    target = paddle.take_along_axis(logits, paddle.to_tensor(y).unsqueeze(1), 1).sum()
    target.backward()
    g = np.abs(xt.grad.numpy()).max(axis=1)
    for i, role in enumerate(roles):
        clamped = role in ("target_cos_above", "target_cos_and_angle_low", "angle_low",
                           "angle_high", "target_cos_below")
        assert (g[i] == 0) == clamped, (role, g[i])


# ---- the head


HEAD_SHAPES = [(1.0, 0), (1.0, 1), (1.0, 3), (0.5, 0), (0.5, 2)]  # (sample ratio, chunk)


@pytest.mark.parametrize("ratio,chunk", HEAD_SHAPES)
@pytest.mark.parametrize("s", [8.0, 16.0])
@pytest.mark.parametrize("num_classes", [8, 23])
def test_head_matches_oracle_on_every_clamp(num_classes, s, ratio, chunk):
    assert_errs(check_adaface_clamps(num_classes, ratio, chunk, s, n=12))


@pytest.mark.parametrize("ratio,chunk", [(1.0, 0), (1.0, 3), (0.5, 0)])
def test_head_tiny_norms_in_eval_mode(ratio, chunk):
    """Norms below 0.001 (clamped: q moves from −0.165 to −0.055) with statistics set, in
    eval mode: the statistics stay, and are used."""
    x, y, w, _ = make_adaface_case(seed=4, n=12, d=16, num_classes=23, tiny=True)
    params = dict(s=16.0, m=0.4, h=0.333)
    o = AdaFaceOracle(**params, batch_mean=0.0015, batch_std=0.002)
    assert adaface_clamp_hits(x, y, w, o)["norm_below"] >= 1
    assert abs(o.raw_q(x)[0] - 0.333 * (1e-5 - 0.0015) / 0.003) > 0.1  # the clamp matters
    head, got, used, _ = run_head_step(AdaFace(**params), 23, x, y, w, ratio, chunk,
                                       setup=set_adaface_stats(0.0015, 0.002), train=False)
    assert adaface_stats(head) == [np.float32(0.0015), np.float32(0.002)]
    remapped = np.searchsorted(used, y)
    assert np.array_equal(used[remapped], y)
    assert_errs(compare_oracle(got, x, remapped, w[used], o, 1, o.q(x)))
    ref = oracle_reference(x, remapped, w[used], o, 1, o.q(x))
    assert row_rel_err(got["dx"], ref["dx"]) < 1e-5


@pytest.mark.parametrize("ratio,chunk", [(1.0, 0), (1.0, 7), (0.5, 0), (0.5, 5)])
def test_head_default_parameters_s64(ratio, chunk):
    """AdaFace() (s = 64, m = 0.4, h = 0.333, t_alpha = 0.01, statistics 20 and 100) on
    well-conditioned data, norms spread over [2, 60]: a training step."""
    x, y, w, _ = make_case(seed=int(ratio * 10) + chunk, n=16, d=16, num_classes=101,
                           margin=ArcFace(64.0, 0.4))
    rng = np.random.RandomState(chunk)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)
         * rng.uniform(2.0, 60.0, (16, 1))).astype("float32")
    head, got, used, _ = run_head_step(AdaFace(), 101, x, y, w, ratio, chunk)
    o = AdaFaceOracle().update(x)
    assert np.ptp(o.q(x)) > 0.05  # q differs between samples
    mean, std = adaface_stats(head)
    assert rel_err(mean, o.batch_mean) < 1e-6 and rel_err(std, o.batch_std) < 1e-6
    remapped = np.searchsorted(used, y)
    assert np.array_equal(used[remapped], y)
    assert_errs(compare_oracle(got, x, remapped, w[used], o, 1, o.q(x)))


@pytest.mark.parametrize("b", [5, 12])
def test_running_statistics_over_steps_then_eval(b):
    assert_errs(check_adaface_steps(23, b=b))


@pytest.mark.parametrize("k", [2, 3])
def test_head_with_subcenters(k):
    """AdaFace with K centres per class (ties included), a training step, chunked."""
    x, y, w = make_subcenter_case(seed=k, n=12, d=16, num_classes=23, sub_centers=k,
                                  margin=ArcFace(16.0, 0.4), ties=(0, 9))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)
         * np.random.RandomState(k).uniform(2.0, 40.0, (12, 1))).astype("float32")
    params = dict(s=16.0, m=0.4, h=0.333, t_alpha=0.5)
    for chunk in (0, 4):
        head, got, used, _ = run_head_step(AdaFace(**params), 23, x, y, w, 1.0, chunk, k)
        o = AdaFaceOracle(**params).update(x)
        assert_errs(compare_oracle(got, x, y, w, o, k, o.q(x)))


def test_buffers_defaults_and_state_dict():
    from plsc.nn import PartialFC
    margin = AdaFace()
    for name, v in (("batch_mean", 20.0), ("batch_std", 100.0)):
        buf = getattr(margin, name)
        assert buf.dtype == paddle.float32 and buf.size == 1 and float(buf) == v
    head = PartialFC(16, 10, margin)
    state = head.state_dict()
    assert "margin.batch_mean" in state and "margin.batch_std" in state
    head.train()
    head(paddle.randn([6, 16]) * 5, paddle.to_tensor([0, 1, 2, 3, 4, 5]))
    trained = adaface_stats(head)
    assert trained != [20.0, 100.0]
    other = PartialFC(16, 10, AdaFace())
    other.set_state_dict(head.state_dict())
    assert adaface_stats(other) == trained
    head.eval()
    assert not margin.training
    head(paddle.randn([6, 16]), paddle.to_tensor([0, 1, 2, 3, 4, 5]))
    assert adaface_stats(head) == trained


def test_buffers_are_float32_scalars_with_the_initial_values():
    """0-d float32 buffers (so `float(margin.batch_mean)` reads them), initially 20 and 100."""
    margin = AdaFace()
    assert margin.batch_mean.shape == [] and margin.batch_std.shape == []
    assert margin.batch_mean.dtype == paddle.float32
    assert (float(margin.batch_mean), float(margin.batch_std)) == (20.0, 100.0)


@pytest.mark.parametrize("opt,ratio,chunk,k", [("momentum", 1.0, 0, 1), ("adamw", 0.5, 7, 1),
                                               ("momentum", 0.5, 0, 3)])
def test_fused_update_equals_separate_bit_for_bit(opt, ratio, chunk, k):
    result = check_fused_vs_separate(opt, None, 101, ratio, chunk, "float32", sub_centers=k,
                                     fresh_margin=lambda: AdaFace(s=16.0, t_alpha=0.5))
    assert result["weight"] == [0] and result["rows_unchanged"] == [0]
    assert not fused_failures(result), fused_failures(result)
