"""Partial FC in one process: the sampled head against the dense oracle restricted to the
sampled classes, and the sparse optimizers against Paddle's dense ones."""
import numpy as np
import paddle
import pytest

from oracles import compare, make_case
from plsc.loss import ArcFace, CosFace, Softmax
from plsc.nn import PartialFC
from plsc.optim import SparseAdamW, SparseMomentum
from test_head_single import forward_backward

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets


def sampled_head(margin, ratio, x, y, w, b=None, seed=3):
    head = PartialFC(x.shape[1], w.shape[0], margin, sample_ratio=ratio, seed=seed)
    return (head, *forward_backward(head, x, y, w, b))


@pytest.mark.parametrize("margin", [ArcFace(), CosFace(), Softmax()], ids=repr)
def test_sampled_head_matches_oracle_on_sampled_classes(margin):
    x, y, w, b = make_case(seed=11, n=16, d=16, num_classes=80, margin=margin)
    head, xt, loss = sampled_head(margin, 0.3, x, y, w, b)
    index = head.sampled_index.numpy()
    assert head.num_sample == len(index) == max(24, len(np.unique(y)))
    assert head.weight.grad is None  # no [num_local, d] gradient buffer
    assert list(head.sampled_weight.grad.shape) == [len(index), 16]
    remap = np.searchsorted(index, y)
    got = {"loss": float(loss), "dx": xt.grad.numpy(), "dw": head.sampled_weight.grad.numpy()}
    if b is not None:
        got["db"] = head.sampled_bias.grad.numpy()
    sub_b = b[index] if b is not None else None
    for key, (err, allowed) in compare(got, x, remap, w[index], margin, sub_b).items():
        assert err <= allowed, (key, err, allowed)
    assert head.num_positive == len(np.unique(y))
    assert head.positive_fraction == len(np.unique(y)) / len(index)


def test_step_counter_advances_in_training_only():
    x, y, w, _ = make_case(seed=2, n=8, d=8, num_classes=40, margin=ArcFace())
    head, _, _ = sampled_head(ArcFace(), 0.25, x, y, w)
    first = head.sampled_index.numpy()
    assert int(head.sample_step) == 1
    head.eval()
    head(paddle.to_tensor(x), paddle.to_tensor(y))
    assert int(head.sample_step) == 1
    # A fresh head told it is at step 0 draws the same centres: resume draws alike.
    again, _, _ = sampled_head(ArcFace(), 0.25, x, y, w)
    np.testing.assert_array_equal(again.sampled_index.numpy(), first)


def _dense_step(opt_cls, rows, grad, **kw):
    """Paddle's own optimizer on a parameter holding just `rows`."""
    p = paddle.create_parameter(list(rows.shape), "float32")
    p.set_value(rows)
    p.grad = paddle.to_tensor(grad)
    opt = opt_cls(parameters=[p], **kw)
    opt.step()
    return p.numpy()


@pytest.mark.parametrize("kind", ["momentum", "nesterov", "adamw"])
def test_sparse_update_touches_sampled_rows_only(kind):
    margin = Softmax()
    x, y, w, b = make_case(seed=5, n=12, d=8, num_classes=60, margin=margin)
    if kind == "adamw":
        opt = SparseAdamW(0.05, weight_decay=0.1)
        dense = lambda rows, g: _dense_step(paddle.optimizer.AdamW, rows, g,  # noqa: E731
                                            learning_rate=0.05, weight_decay=0.1)
    else:
        nesterov = kind == "nesterov"
        opt = SparseMomentum(0.1, momentum=0.9, weight_decay=5e-4, use_nesterov=nesterov)
        dense = lambda rows, g: _dense_step(paddle.optimizer.Momentum, rows, g,  # noqa: E731
                                            learning_rate=0.1, momentum=0.9, weight_decay=5e-4,
                                            use_nesterov=nesterov)
    head, _, _ = sampled_head(margin, 0.2, x, y, w, b)
    index = head.sampled_index.numpy()
    grads = {"weight": head.sampled_weight.grad.numpy(), "bias": head.sampled_bias.grad.numpy()}
    before = {"weight": head.weight.numpy().copy(), "bias": head.bias.numpy().copy()}
    opt.step(head)
    assert head.sampled_weight is None  # consumed
    other = np.setdiff1d(np.arange(60), index)
    for name in ("weight", "bias"):
        after = getattr(head, name).numpy()
        np.testing.assert_array_equal(after[other], before[name][other])
        np.testing.assert_allclose(after[index], dense(before[name][index], grads[name]),
                                   rtol=1e-6, atol=1e-7)

    # State of rows not sampled in a later step stays bit-identical too.
    state = {k: v.numpy().copy() for k, v in opt.state_dict().items()}
    head(paddle.to_tensor(x[::-1].copy()), paddle.to_tensor(y[::-1].copy())).backward()
    index2 = head.sampled_index.numpy()
    opt.step(head)
    other2 = np.setdiff1d(np.arange(60), index2)
    for key, value in opt.state_dict().items():
        np.testing.assert_array_equal(value.numpy()[other2], state[key][other2])
        assert not np.array_equal(value.numpy()[index2], state[key][index2]), key


def test_momentum_matches_the_literal_formula_over_steps():
    """Three steps with changing samples against numpy: v = μv + g + wd·w; w -= lr·v per used row."""
    x, y, w, _ = make_case(seed=8, n=8, d=8, num_classes=40, margin=CosFace())
    head = PartialFC(8, 40, CosFace(), sample_ratio=0.3)
    head.weight.set_value(w)
    opt = SparseMomentum(0.2, momentum=0.9, weight_decay=1e-3)
    w_ref, v_ref = w.astype("float64"), np.zeros_like(w, dtype="float64")
    for step in range(3):
        head(paddle.to_tensor(np.roll(x, step, axis=0)), paddle.to_tensor(np.roll(y, step))).backward()
        idx, g = head.sampled_index.numpy(), head.sampled_weight.grad.numpy().astype("float64")
        v_ref[idx] = 0.9 * v_ref[idx] + g + 1e-3 * w_ref[idx]
        w_ref[idx] -= 0.2 * v_ref[idx]
        opt.step(head)
        np.testing.assert_allclose(head.weight.numpy(), w_ref, rtol=1e-5, atol=1e-6)


def test_ratio_one_is_the_model_parallel_head_and_dense_update():
    margin = ArcFace()
    x, y, w, _ = make_case(seed=9, n=10, d=8, num_classes=30, margin=margin)
    full = PartialFC(8, 30, margin)
    full.weight.set_value(w)
    same, _, loss = sampled_head(margin, 1.0, x, y, w)
    ref_loss = full(paddle.to_tensor(x), paddle.to_tensor(y))
    ref_loss.backward()
    assert float(loss) == float(ref_loss) and same.sampled_index is None
    np.testing.assert_array_equal(same.weight.grad.numpy(), full.weight.grad.numpy())
    grad = same.weight.grad.numpy()
    SparseMomentum(0.1, momentum=0.9, weight_decay=5e-4).step(same)
    expect = _dense_step(paddle.optimizer.Momentum, w, grad, learning_rate=0.1, momentum=0.9,
                         weight_decay=5e-4)
    np.testing.assert_allclose(same.weight.numpy(), expect, rtol=1e-6, atol=1e-7)
