"""Sub-centres (K centres per class, a class's cosine the maximum over them) in one process
against the float64 dense oracle (tests/oracles.py), and the oracle itself checked."""
import numpy as np
import paddle
import pytest

from head_cases.adaface_subcenters import check_subcenters
from head_cases.fused import check_fused_vs_separate, fused_failures
from oracles import (class_rows, dense_reference, make_case, make_subcenter_case,
                     finite_difference_grads, oracle_reference, subcenter_cos)
from plsc.loss import ArcFace, CombinedMargin, CosFace

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets

MARGINS = {"arcface": ArcFace, "cosface": CosFace}


def _leaf(a):
    t = paddle.to_tensor(np.asarray(a, dtype="float64"))
    t.stop_gradient = False
    return t


# ---- the oracle


def test_oracle_ties_are_bit_equal_and_go_to_the_first_centre():
    x, y, w = make_subcenter_case(seed=1, n=8, d=16, num_classes=5, sub_centers=3,
                                  margin=ArcFace(), ties=(1, 3))
    xt, wt = _leaf(x), _leaf(w)
    cos_all = subcenter_cos(xt, wt, 1).numpy().reshape(8, 5, 3)
    for c in (1, 3):  # identical rows: bit-equal cosines for every sample
        assert np.array_equal(cos_all[:, c, 0], cos_all[:, c, 1])
        assert np.array_equal(cos_all[:, c, 0], cos_all[:, c, 2])
    cos = subcenter_cos(xt, wt, 3)
    coef = np.random.RandomState(0).normal(size=(8, 5))
    (cos * paddle.to_tensor(coef)).sum().backward()
    g = wt.grad.numpy().reshape(5, 3, 16)
    for c in (1, 3):
        assert np.abs(g[c, 0]).max() > 0 and not np.abs(g[c, 1:]).any()
    # Untied classes: the gradient is on each sample's argmax centre only.
    best = cos_all.argmax(axis=2)
    for c in (0, 2, 4):
        for j in range(3):
            assert bool(np.abs(g[c, j]).max() > 0) == bool((best[:, c] == j).any())


@pytest.mark.parametrize("name", sorted(MARGINS))
def test_oracle_with_one_centre_is_the_dense_reference(name):
    margin = MARGINS[name]()
    x, y, w, _ = make_case(seed=3, n=10, d=16, num_classes=9, margin=margin)
    got = oracle_reference(x, y, w, margin)
    ref = dense_reference(x, y, w, margin)
    for key in ("loss", "dx", "dw"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-10, atol=1e-12)


def test_oracle_is_the_dense_reference_on_the_maximal_centres():
    """With K centres, the loss equals the K = 1 loss on the selected centres, and the
    gradient of a centre is that centre's gradient there, summed over the samples choosing it."""
    margin = CombinedMargin(32.0, 1.0, 0.3, 0.1)
    x, y, w = make_subcenter_case(seed=4, n=6, d=16, num_classes=4, sub_centers=2,
                                  margin=margin)
    got = oracle_reference(x, y, w, margin, 2)
    xh = x / np.linalg.norm(x, axis=1, keepdims=True)
    wh = w / np.linalg.norm(w, axis=1, keepdims=True)
    best = (xh.astype("float64") @ wh.T.astype("float64")).reshape(6, 4, 2).argmax(axis=2)
    for i in range(6):  # per sample: its own choice of centres
        rows = np.arange(4) * 2 + best[i]
        one = dense_reference(x[i:i + 1], y[i:i + 1], w[rows], margin)
        np.testing.assert_allclose(got["per_sample"][i], one["loss"], rtol=1e-10)


def test_oracle_gradients_match_finite_differences():
    margin = CosFace(s=8.0, m=0.35)
    x, y, w = make_subcenter_case(seed=5, n=5, d=6, num_classes=4, sub_centers=3,
                                  margin=margin, low=0.5, high=5.0)
    ref = oracle_reference(x, y, w, margin, 3)

    num = finite_difference_grads(lambda xv, wv: oracle_reference(xv, y, wv, margin, 3)["loss"],
                                  x, w)
    for key in ("dx", "dw"):
        np.testing.assert_allclose(ref[key], num[key], rtol=1e-5,
                                   atol=1e-7 * np.abs(num[key]).max())


# ---- the head


@pytest.mark.parametrize("ratio,chunk", [(1.0, 0), (1.0, 1), (1.0, 4), (0.5, 0), (0.5, 3)])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("name", sorted(MARGINS))
def test_head_matches_oracle_with_ties(name, k, ratio, chunk):
    errs = check_subcenters(MARGINS[name](), 23, ratio, chunk, k, ties=(0, 4, 11, 22), n=12)
    for key, (err, allowed) in errs.items():
        assert err <= allowed, (key, err, allowed)


def test_weight_layout_and_sampled_rows():
    from plsc.nn import PartialFC
    head = PartialFC(16, 23, CosFace(), sample_ratio=0.4, sub_centers=3, seed=2)
    assert head.weight.shape == [69, 16]
    x = paddle.randn([10, 16])
    y = paddle.to_tensor(np.arange(0, 20, 2), dtype="int64")
    head(x, y).backward()
    index = head.sampled_index.numpy()
    assert np.all(np.diff(index) > 0) and set(range(0, 20, 2)) <= set(index.tolist())
    assert head.sampled_weight.shape == [len(index) * 3, 16]
    assert head.sampled_weight.grad.shape == [len(index) * 3, 16]
    head2 = PartialFC(16, 23, CosFace(), sample_ratio=0.4, sub_centers=3, seed=2)
    head2.weight.set_value(head.weight)
    head2(x, y)  # the same draw: the gathered rows are the classes' K rows, class-major
    np.testing.assert_array_equal(head2.sampled_weight.numpy(),
                                  head.weight.numpy()[class_rows(index, 3)])


@pytest.mark.parametrize("opt,ratio,chunk", [("momentum", 0.5, 7), ("adamw", 1.0, 0),
                                             ("momentum", 1.0, 6)])
def test_fused_update_equals_separate_bit_for_bit(opt, ratio, chunk):
    result = check_fused_vs_separate(opt, ArcFace(), 101, ratio, chunk, "float32",
                                     sub_centers=3)
    assert result["weight"] == [0] and result["rows_unchanged"] == [0]
    assert not fused_failures(result), fused_failures(result)
