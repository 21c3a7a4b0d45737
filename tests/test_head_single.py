"""The head in one process (world size 1) against the dense oracle, and its input checks."""
import numpy as np
import paddle
import pytest

from oracles import compare, dense_reference, make_case, published_margin, rel_err
from plsc.loss import ArcFace, CombinedMargin, CosFace, Softmax
from plsc.nn import PartialFC

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets

MARGINS = {  # the named margins at their defaults: the oracle uses the published parameters
    "arcface": lambda: published_margin("ArcFace"),
    "arcface_st": lambda: published_margin("ArcFace", straight_through=True),
    "cosface": lambda: published_margin("CosFace"),
    "sphereface": lambda: published_margin("SphereFace"),
    "combined": lambda: CombinedMargin(64.0, 1.2, 0.3, 0.1),
    "softmax": lambda: Softmax(),
}


def forward_backward(head, x, y, w, b=None):
    """`head` with weight `w` (and bias `b`) run forward and backward on `x, y`: (x tensor, loss)."""
    head.weight.set_value(w)
    if b is not None:
        head.bias.set_value(b)
    xt = paddle.to_tensor(x)
    xt.stop_gradient = False
    loss = head(xt, paddle.to_tensor(y))
    loss.backward()
    return xt, loss


def run_head(margin, x, y, w, b=None, **head_kwargs):
    head = PartialFC(x.shape[1], w.shape[0], margin, **head_kwargs)
    xt, loss = forward_backward(head, x, y, w, b)
    out = {"loss": float(loss), "dx": xt.grad.numpy(), "dw": head.weight.grad.numpy()}
    if b is not None:
        out["db"] = head.bias.grad.numpy()
    out["head"] = head
    return out


@pytest.mark.parametrize("name", sorted(MARGINS))
@pytest.mark.parametrize("num_classes", [2, 7, 101])
def test_matches_dense_oracle(name, num_classes):
    margin = MARGINS[name]()
    x, y, w, b = make_case(seed=num_classes, n=12, d=16, num_classes=num_classes, margin=margin)
    got = run_head(margin, x, y, w, b)
    got.pop("head")
    for key, (err, allowed) in compare(got, x, y, w, margin, b).items():
        assert err <= allowed, (key, err, allowed)


@pytest.mark.parametrize("name", sorted(MARGINS))
def test_matches_dense_oracle_in_column_slabs(name, monkeypatch):
    """The wide-block backward (each slab of classes copied and scaled for its GEMMs, the
    embedding gradient summed over the slabs), forced on a small head: slabs of 7 classes."""
    import plsc.nn.parallel_softmax as ps
    monkeypatch.setattr(ps, "_WGRAD_BLOCK_BYTES", 0)
    monkeypatch.setattr(ps, "_WGRAD_SLAB", 7)
    monkeypatch.setattr(ps, "_DEVICE_WGRAD_BYTES", 7 * 4 * 16)  # the device set's: 7 rows
    margin = MARGINS[name]()
    x, y, w, b = make_case(seed=3, n=12, d=16, num_classes=101, margin=margin)
    got = run_head(margin, x, y, w, b)
    got.pop("head")
    for key, (err, allowed) in compare(got, x, y, w, margin, b).items():
        assert err <= allowed, (key, err, allowed)


def test_loss_beyond_paddle_clamp_is_exact():
    """Per-sample losses above 64, where paddle's cross_entropy saturates: numpy float64 reference."""
    rng = np.random.RandomState(3)
    n, d, c = 6, 16, 50
    w = rng.normal(size=(c, d)).astype("float32")
    y = rng.randint(0, c, n)
    x = (-w[y] + 0.1 * rng.normal(size=(n, d))).astype("float32")  # embeddings opposite their class
    got = run_head(CosFace(s=64.0, m=0.4), x, y, w)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    wn = w / np.linalg.norm(w, axis=1, keepdims=True)
    logits = 64.0 * (xn.astype("float64") @ wn.T.astype("float64"))
    logits[np.arange(n), y] -= 64.0 * 0.4
    mx = logits.max(axis=1)
    per = mx + np.log(np.exp(logits - mx[:, None]).sum(axis=1)) - logits[np.arange(n), y]
    assert per.min() > 64.0  # the regime under test
    assert abs(got["loss"] - per.mean()) / per.mean() < 1e-6


def test_sample_loss_and_no_grad_for_frozen_weight():
    x, y, w, _ = make_case(seed=5, n=8, d=16, num_classes=9, margin=CosFace())
    head = PartialFC(16, 9, CosFace())
    head.weight.set_value(w)
    head.weight.stop_gradient = True
    xt = paddle.to_tensor(x)
    xt.stop_gradient = False
    loss = head(xt, paddle.to_tensor(y))
    loss.backward()
    assert head.weight.grad is None
    ref = dense_reference(x, y, w, CosFace())
    assert rel_err(xt.grad.numpy(), ref["dx"]) < 1e-5
    assert head.sample_loss.shape == [8]
    assert abs(float(head.sample_loss.mean()) - float(loss)) < 1e-5 * abs(float(loss))


def test_labels_as_column_and_int32():
    x, y, w, _ = make_case(seed=6, n=8, d=16, num_classes=9, margin=ArcFace())
    head = PartialFC(16, 9)
    head.weight.set_value(w)
    a = float(head(paddle.to_tensor(x), paddle.to_tensor(y)))
    b = float(head(paddle.to_tensor(x), paddle.to_tensor(y.astype("int32").reshape(-1, 1))))
    assert a == b


@pytest.mark.parametrize("bad", [-1, 9, 1000])
def test_bad_label_names_value_and_range(bad):
    head = PartialFC(4, 9)
    y = paddle.to_tensor([0, bad, 3], dtype="int64")
    with pytest.raises(ValueError, match=rf"label {bad} on rank 0 is outside \[0, 9\)"):
        head(paddle.randn([3, 4]), y)


def test_deferred_label_check_raises_on_reading_the_loss():
    head = PartialFC(4, 9, check_inputs="labels")
    x = paddle.randn([3, 4])
    loss = head(x, paddle.to_tensor([0, 12, 3], dtype="int64"))  # no read, no error yet
    assert np.isfinite(float(loss))
    with pytest.raises(ValueError, match=r"label 12 on rank 0 is outside \[0, 9\) \(1 bad"):
        head.loss_value(loss)
    good = head(x, paddle.to_tensor([0, 8, 3], dtype="int64"))
    assert head.loss_value(good) == float(good)
    with pytest.raises(ValueError, match="check_inputs"):
        PartialFC(4, 9, check_inputs="yes")


def test_shape_and_dtype_errors():
    head = PartialFC(4, 9)
    with pytest.raises(ValueError, match=r"shape \[batch, 4\]"):
        head(paddle.randn([3, 5]), paddle.to_tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="3 embeddings"):
        head(paddle.randn([3, 4]), paddle.to_tensor([0, 1]))
    with pytest.raises(TypeError, match="int32 or int64"):
        head(paddle.randn([3, 4]), paddle.to_tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"sample_ratio must be in \(0, 1\]"):
        PartialFC(4, 9, sample_ratio=0.0)
    with pytest.raises(TypeError, match="plsc.loss.Margin"):
        PartialFC(4, 9, margin="arcface")


@pytest.mark.parametrize("name", sorted(MARGINS))
@pytest.mark.parametrize("chunk", [1, 3, 10])
def test_chunked_head_equals_dense(name, chunk):
    """Blocks of `chunk` classes give the dense head's loss and gradients (and the oracle's)."""
    margin = MARGINS[name]()
    x, y, w, b = make_case(seed=chunk + 40, n=12, d=16, num_classes=23, margin=margin)
    dense = run_head(margin, x, y, w, b)
    got = run_head(margin, x, y, w, b, chunk_size=chunk)
    assert got.pop("head").last_chunk_size == chunk and dense.pop("head").last_chunk_size is None
    for key in dense:
        assert rel_err(got[key], dense[key]) < 1e-5, (key, rel_err(got[key], dense[key]))
    for key, (err, allowed) in compare(got, x, y, w, margin, b).items():
        assert err <= allowed, (key, err, allowed)


def test_auto_chunk_follows_the_logits_budget():
    head = PartialFC(8, 1000, logits_budget=4 * 16 * 1000)  # exactly the dense logits of N=16
    x, y = paddle.randn([16, 8]), paddle.randint(0, 1000, [16])
    head(x, y)
    assert head.last_chunk_size is None
    head(paddle.randn([17, 8]), paddle.randint(0, 1000, [17]))
    assert head.last_chunk_size == (4 * 16 * 1000) // (4 * 17)
    with pytest.raises(ValueError, match="chunk_size must be 'auto', 0"):
        PartialFC(8, 10, chunk_size=-1)
