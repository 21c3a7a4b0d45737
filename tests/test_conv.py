"""plsc.models.conv.Conv2D (oneDNN on the CPU kernel set) against Paddle's own conv2d.

The oracle is `paddle.nn.functional.conv2d` and its autograd gradients (Paddle's im2col + GEMM
kernels, an implementation independent of oneDNN's). Each case also checks which path ran, so
a silent fall-back cannot pass for the oneDNN path."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from plsc.kernels import onednn
from plsc.models.conv import Conv2D, takes_onednn

CASES = [
    # in, out, kernel, stride, padding, groups, dilation, bias, height, width
    (3, 8, 3, 1, 1, 1, 1, False, 9, 9),
    (8, 16, 3, 2, 1, 1, 1, True, 10, 11),
    (16, 16, 3, 2, 1, 16, 1, False, 12, 12),     # depthwise, as MobileFaceNet's
    (16, 16, 7, 1, 0, 16, 1, False, 7, 7),       # the global depthwise conv (GDC)
    (8, 8, 1, 1, 0, 1, 1, True, 5, 5),
    (4, 6, (2, 3), (1, 2), [1, 0], 2, 1, True, 8, 9),
    (16, 32, 3, 1, [0, 1, 2, 1], 1, 1, False, 9, 9),   # asymmetric: top, bottom, left, right
    (4, 4, 3, 1, 2, 1, 2, True, 9, 9),           # dilated
    (3, 12, 9, 9, 0, 1, 1, True, 22, 22),        # ViT's patch embedding (rows left unseen)
]


@pytest.mark.parametrize("case", CASES)
def test_matches_paddle_conv2d(case, kernels):
    cin, cout, k, stride, padding, groups, dilation, bias, h, w = case
    paddle.seed(7)
    conv = Conv2D(cin, cout, k, stride=stride, padding=padding, groups=groups,
                  dilation=dilation, bias_attr=None if bias else False)
    x = paddle.randn([3, cin, h, w])
    x.stop_gradient = False
    assert takes_onednn(x, conv.weight) == (kernels == "cpu")
    planned = onednn.plan_count()
    y = conv(x)
    if kernels == "cpu":  # a new geometry was planned, so oneDNN ran
        assert onednn.plan_count() == planned + 1
    upstream = paddle.randn(y.shape)
    (y * upstream).sum().backward()
    got = [y.numpy(), x.grad.numpy(), conv.weight.grad.numpy()]
    got += [conv.bias.grad.numpy()] if bias else []

    x2 = x.detach()
    x2.stop_gradient = False
    w2 = conv.weight.detach()
    w2.stop_gradient = False
    b2 = None
    if bias:
        b2 = conv.bias.detach()
        b2.stop_gradient = False
    y2 = F.conv2d(x2, w2, b2, stride=stride, padding=padding, dilation=dilation, groups=groups)
    (y2 * upstream).sum().backward()
    want = [y2.numpy(), x2.grad.numpy(), w2.grad.numpy()] + ([b2.grad.numpy()] if bias else [])
    for name, g, r in zip(["y", "dx", "dw", "db"], got, want):
        assert g.shape == r.shape, name
        scale = max(1.0, float(np.abs(r).max()))
        np.testing.assert_allclose(g, r, rtol=0, atol=2e-5 * scale, err_msg=name)


def test_gradients_only_where_asked():
    """A frozen input (the first layer's images) gets no gradient; a frozen weight neither."""
    paddle.seed(3)
    conv = Conv2D(4, 8, 3, padding=1)
    x = paddle.randn([2, 4, 6, 6])
    y = conv(x)
    y.sum().backward()
    assert x.grad is None and conv.weight.grad is not None and conv.bias.grad is not None
    dw = conv.weight.grad.numpy().copy()
    conv.clear_gradients(set_to_zero=False)
    conv.weight.stop_gradient = True
    x.stop_gradient = False
    conv(x).sum().backward()
    assert conv.weight.grad is None and x.grad is not None and conv.bias.grad is not None
    w = conv.weight.detach()
    xr = x.detach()
    xr.stop_gradient = False
    F.conv2d(xr, w, conv.bias.detach(), padding=1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), xr.grad.numpy(), atol=2e-5)
    wr = conv.weight.detach()
    wr.stop_gradient = False
    F.conv2d(x.detach(), wr, padding=1).sum().backward()
    np.testing.assert_allclose(dw, wr.grad.numpy(), atol=2e-5)


def test_strided_input_and_repeated_geometry():
    """A transposed (non-contiguous) input is read right; two layers of one geometry share a
    plan and still compute with their own weights; the gradient accumulates over two calls."""
    paddle.seed(5)
    a, b = Conv2D(6, 6, 3, padding=1), Conv2D(6, 6, 3, padding=1)
    x = paddle.randn([2, 6, 7, 7]).transpose([0, 1, 3, 2])
    assert not x.is_contiguous()
    planned = onednn.plan_count()
    ya, yb = a(x), b(x)
    assert onednn.plan_count() <= planned + 1
    xc = x.contiguous()
    np.testing.assert_allclose(ya.numpy(), F.conv2d(xc, a.weight, a.bias, padding=1).numpy(),
                               atol=2e-5)
    np.testing.assert_allclose(yb.numpy(), F.conv2d(xc, b.weight, b.bias, padding=1).numpy(),
                               atol=2e-5)
    xs = paddle.randn([2, 6, 7, 7]).transpose([0, 1, 3, 2])
    xs.stop_gradient = False
    a(xs).sum().backward()  # a strided input that needs its gradient gets it
    xr = xs.detach().contiguous()
    xr.stop_gradient = False
    F.conv2d(xr, a.weight.detach(), a.bias.detach(), padding=1).sum().backward()
    np.testing.assert_allclose(xs.grad.numpy(), xr.grad.numpy(), atol=2e-5)
    a.clear_gradients(set_to_zero=False)
    (a(x).sum() + a(x).sum()).backward()
    wr = a.weight.detach()
    wr.stop_gradient = False
    (2 * F.conv2d(xc, wr, padding=1).sum()).backward()
    np.testing.assert_allclose(a.weight.grad.numpy(), wr.grad.numpy(), rtol=1e-5, atol=1e-4)


def test_other_dtypes_and_layouts_take_paddle():
    conv = Conv2D(4, 4, 3, padding=1)
    assert takes_onednn(paddle.randn([1, 4, 5, 5]), conv.weight)
    assert not takes_onednn(paddle.randn([1, 4, 5, 5]).astype("float64"), conv.weight)
    same = Conv2D(4, 4, 3, padding="SAME")
    x = paddle.randn([1, 4, 5, 5])
    planned = onednn.plan_count()
    np.testing.assert_allclose(same(x).numpy(), F.conv2d(x, same.weight, same.bias,
                                                         padding="SAME").numpy())
    assert onednn.plan_count() == planned


def test_library_is_paddles_onednn_3():
    assert onednn.available(), "Paddle's CPU wheel bundles libdnnl.so.3"
    assert onednn.version().split(".")[0] == "3"


def test_plans_share_scratch_bounded_by_the_largest_geometry():
    """The blocked copies live in `library.SCRATCH`'s few slots, not one buffer per plan and
    argument: smaller geometries planned after a larger one add no scratch, and the scratch is
    at most four slots of the largest padded activation plus its weights' copies."""
    if not onednn.available():
        pytest.skip("no oneDNN")
    from plsc.kernels.onednn.library import SCRATCH

    def step(cin, cout, hw, stride):
        conv = Conv2D(cin, cout, 3, stride=stride, padding=1, bias_attr=False)
        x = paddle.randn([4, cin, hw, hw])
        x.stop_gradient = False
        if not takes_onednn(x, conv.weight):
            pytest.skip("the CPU kernel set is not in use")
        conv(x).sum().backward()

    SCRATCH.release()
    step(32, 32, 40, 1)
    big = onednn.scratch_bytes()
    activation = 4 * 32 * 40 * 40 * 4  # bytes of the largest input or output
    weights = 32 * 32 * 3 * 3 * 4
    assert 0 < big <= 4 * (2 * activation + 2 * weights)  # padding at most doubles a copy
    for cin, cout, hw, stride in [(16, 32, 20, 2), (32, 16, 12, 1), (16, 16, 24, 1), (8, 32, 16, 2)]:
        step(cin, cout, hw, stride)
    assert onednn.scratch_bytes() == big


def test_scratch_slots_grow_and_release():
    from plsc.kernels.onednn.library import Scratch
    s = Scratch()
    a = s.address("a", 10_000)
    assert a % 4096 == 0 and s.nbytes() == 12_288
    assert s.address("a", 5_000) == a  # large enough: the same buffer
    s.address("a", 50_000)
    s.address("b", 1)
    assert s.nbytes() == 53_248 + 4096
    s.release()
    assert s.nbytes() == 0


def _staged_case(seed, batch, size):
    """oneDNN's conv module, the shared scratch, an 8 -> 16 3 x 3 Conv2D with bias and an
    input [batch, 8, size, size] on the oneDNN path (else the test is skipped)."""
    if not onednn.available():
        pytest.skip("no oneDNN")
    from plsc.kernels.onednn import conv as onednn_conv
    from plsc.kernels.onednn.library import SCRATCH
    paddle.seed(seed)
    conv = Conv2D(8, 16, 3, stride=1, padding=1)
    x = paddle.randn([batch, 8, size, size])
    if not takes_onednn(x, conv.weight):
        pytest.skip("the CPU kernel set is not in use")
    return onednn_conv, SCRATCH, conv, x


def test_forward_without_gradients_keeps_the_scratch_and_the_values(monkeypatch):
    """Under `paddle.no_grad` (an evaluation) a batch whose blocked copies exceed what the
    scratch holds runs in pieces of samples: the scratch does not grow to the batch, and the
    output equals Paddle's conv2d and the one-call forward."""
    onednn_conv, SCRATCH, conv, x = _staged_case(3, 13, 20)
    with paddle.no_grad():
        want = F.conv2d(x, conv.weight, conv.bias, padding=1).numpy()
        SCRATCH.release()
        whole = conv(x).numpy()  # the default budget takes the batch in one call
        whole_bytes = onednn.scratch_bytes()
        SCRATCH.release()
        per_sample = 16 * 20 * 20 * 4  # the largest plain activation of one sample
        monkeypatch.setattr(onednn_conv, "CALL_BYTES", 3 * per_sample)
        plan = onednn.plan(x.shape, conv.weight.shape, (1, 1), (1, 1), (1, 1), (1, 1), 1, True)
        assert 1 < onednn.samples_per_call(plan, 13) < 13
        pieces = conv(x).numpy()
        assert onednn.scratch_bytes() < whole_bytes / 2
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(pieces, whole)
    with paddle.no_grad():  # an empty share of an evaluation
        assert conv(paddle.zeros([0, 8, 20, 20])).shape == [0, 16, 20, 20]


def test_gradients_fall_back_to_any_layout(monkeypatch):
    """Where oneDNN has no gradient kernel for the forward's layouts, it chooses the layouts
    ("any"): the gradients still equal Paddle's."""
    if not onednn.available():
        pytest.skip("no oneDNN")
    from plsc.kernels.onednn import conv as onednn_conv
    lib = onednn_conv.lib()
    tried = []

    class Refusing:  # oneDNN's constructors, refusing the forward's layouts
        def __getattr__(self, name):
            real = getattr(lib, name)
            if "backward" not in name:
                return real

            def create(pd, eng, alg, src, *rest):
                tried.append(name)
                return 3 if len(tried) % 2 else real(pd, eng, alg, src, *rest)  # unimplemented
            return create
    monkeypatch.setattr(onednn_conv, "lib", lambda: Refusing())
    paddle.seed(13)
    conv = Conv2D(16, 16, 3, stride=2, padding=1, bias_attr=False)
    x = paddle.randn([3, 16, 11, 13])  # a geometry no other test plans
    if not takes_onednn(x, conv.weight):
        pytest.skip("the CPU kernel set is not in use")
    x.stop_gradient = False
    conv(x).sum().backward()
    assert len(tried) == 4  # the data and the weight gradient: each tried twice
    xr = x.detach()
    xr.stop_gradient = False
    wr = conv.weight.detach()
    wr.stop_gradient = False
    F.conv2d(xr, wr, stride=2, padding=1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), xr.grad.numpy(), atol=2e-5)
    np.testing.assert_allclose(conv.weight.grad.numpy(), wr.grad.numpy(), rtol=1e-5, atol=1e-4)


def test_strided_gradients_take_the_forward_layouts():
    """A strided convolution's gradients read and write the activations in the layouts its
    forward chose (oneDNN would otherwise choose channels-last for the data gradient, and
    reorder into and out of it), and equal Paddle's."""
    if not onednn.available():
        pytest.skip("no oneDNN")
    from plsc.kernels.onednn.library import lib
    paddle.seed(17)
    conv = Conv2D(32, 32, 3, stride=2, padding=1, bias_attr=False)
    x = paddle.randn([2, 32, 14, 15])
    if not takes_onednn(x, conv.weight):
        pytest.skip("the CPU kernel set is not in use")
    x.stop_gradient = False
    y = conv(x)
    upstream = paddle.randn(y.shape)
    (y * upstream).sum().backward()
    plan = onednn.plan(x.shape, conv.weight.shape, (2, 2), (1, 1), (1, 1), (1, 1), 1, False)
    data, weights = plan.bwd_data[1], plan.bwd_weights[1]
    for arg, fwd in ((data["diff_src"], "src"), (data["diff_dst"], "dst"),
                     (weights["src"], "src"), (weights["diff_dst"], "dst")):
        assert lib().dnnl_memory_desc_equal(arg.wanted, plan.fwd_args[fwd].wanted)
    assert not plan.fwd_args["src"].same  # blocked, not the plain layout
    xr = x.detach()
    xr.stop_gradient = False
    wr = conv.weight.detach()
    wr.stop_gradient = False
    (F.conv2d(xr, wr, stride=2, padding=1) * upstream).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), xr.grad.numpy(), atol=2e-5)
    np.testing.assert_allclose(conv.weight.grad.numpy(), wr.grad.numpy(), rtol=1e-5, atol=1e-4)


def test_training_in_pieces_matches_paddle_and_bounds_the_scratch(monkeypatch):
    """A training call whose staged activations exceed the budget runs forward and gradients
    in pieces of the batch (the weight and bias gradients summed over the pieces): the values
    against Paddle's conv2d and its autograd, and the scratch below the one-call size."""
    onednn_conv, SCRATCH, conv, x = _staged_case(5, 7, 12)
    upstream = paddle.randn([7, 16, 12, 12])

    def step():
        xs = x.detach()
        xs.stop_gradient = False
        conv.clear_gradients()
        y = conv(xs)
        (y * upstream).sum().backward()
        return [y.numpy(), xs.grad.numpy(), conv.weight.grad.numpy(), conv.bias.grad.numpy()]
    SCRATCH.release()
    step()
    whole_bytes = onednn.scratch_bytes()
    SCRATCH.release()
    monkeypatch.setattr(onednn_conv, "CALL_BYTES", 3 * 16 * 12 * 12 * 4)  # 3 samples a piece
    plan = onednn.plan(x.shape, conv.weight.shape, (1, 1), (1, 1), (1, 1), (1, 1), 1, True)
    assert onednn.samples_per_call(plan, 7) == 3  # pieces of 3, 3 and 1
    got = step()
    # the staged output: 3 samples' instead of 7 (the weights' blocked copy stays as it was)
    assert onednn.scratch_bytes() <= whole_bytes - 4 * 16 * 12 * 12 * 4
    x2, w2, b2 = (t.detach() for t in (x, conv.weight, conv.bias))
    for t in (x2, w2, b2):
        t.stop_gradient = False
    y2 = F.conv2d(x2, w2, b2, padding=1)
    (y2 * upstream).sum().backward()
    for name, g, r in zip(["y", "dx", "dw", "db"], got,
                          [y2.numpy(), x2.grad.numpy(), w2.grad.numpy(), b2.grad.numpy()]):
        np.testing.assert_allclose(g, r, rtol=0, atol=2e-5 * max(1.0, float(np.abs(r).max())),
                                   err_msg=name)


def test_an_evaluation_gives_the_scratch_back():
    """The trainer's evaluation (its batch grows the shared slots past the steps' sizes)
    unmaps the scratch when it ends, so the steps after it take only their own sizes."""
    from types import SimpleNamespace

    from plsc.kernels.onednn.library import SCRATCH
    from plsc.train.trainer import Trainer
    SCRATCH.address("a", 1 << 20)
    assert onednn.scratch_bytes() >= 1 << 20
    trainer = SimpleNamespace(backbone=paddle.nn.Linear(2, 2), step=0, best={}, eval_history=[],
                              evaluator=lambda backbone, with_roc: {})
    assert Trainer.evaluate(trainer) == {}
    assert onednn.scratch_bytes() == 0
