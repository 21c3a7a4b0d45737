"""The head's reused step buffers: same numbers as fresh buffers, and never handed to two users."""
import numpy as np
import paddle
import pytest

from plsc.loss import ArcFace, Softmax
from plsc.nn import PartialFC, Workspace


def make_head(reuse, ratio=1.0, chunk=0, margin=None, classes=50, d=8):
    paddle.seed(5)
    return PartialFC(d, classes, margin or ArcFace(s=16.0), sample_ratio=ratio, seed=1,
                     chunk_size=chunk, reuse_buffers=reuse)


def run_steps(head, batches):
    """Forward + backward per batch; returns per step (loss, dx, weight gradient rows)."""
    out = []
    for x, y in batches:
        xt = paddle.to_tensor(x)
        xt.stop_gradient = False
        loss = head(xt, paddle.to_tensor(y))
        loss.backward()
        rows = head.sampled_weight if head.sampled_weight is not None else head.weight
        out.append((float(loss), xt.grad.numpy(), rows.grad.numpy()))
        head.weight.grad = None
        head.release_sampled_rows()
    return out


def batches(n=3, b=6, d=8, classes=50):
    rng = np.random.RandomState(0)
    return [(rng.normal(size=(b, d)).astype("float32"), rng.randint(0, classes, b)) for _ in range(n)]


@pytest.mark.parametrize("ratio, chunk, margin", [(1.0, 0, ArcFace(s=16.0)), (1.0, 16, ArcFace(s=16.0)),
                                                  (0.4, 0, Softmax()), (0.4, 8, ArcFace(s=16.0))])
def test_reused_buffers_give_the_fresh_buffers_numbers(ratio, chunk, margin):
    data = batches()
    fresh = run_steps(make_head(False, ratio, chunk, margin), data)
    head = make_head(True, ratio, chunk, margin)
    reused = run_steps(head, data)
    for a, b in zip(fresh, reused):
        assert a[0] == b[0]
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_array_equal(a[2], b[2])
    assert head.workspace.nbytes > 0


def test_a_buffer_is_reused_from_step_to_step():
    head = make_head(True, ratio=0.4)
    ptrs = []
    for x, y in batches():
        loss = head(paddle.to_tensor(x), paddle.to_tensor(y))
        loss.backward()
        ptrs.append(head.sampled_weight.data_ptr())
        head.release_sampled_rows()
    assert len(set(ptrs)) == 1


def test_two_forwards_before_one_backward_stay_exact():
    """The second forward finds the buffers lent and allocates its own."""
    data = batches(2)
    ref = [run_steps(make_head(False), [batch])[0] for batch in data]
    head = make_head(True)
    xs = [paddle.to_tensor(x) for x, _ in data]
    for x in xs:
        x.stop_gradient = False
    losses = [head(x, paddle.to_tensor(y)) for x, (_, y) in zip(xs, data)]
    (losses[0] + losses[1]).backward()
    for x, loss, (ref_loss, ref_dx, _) in zip(xs, losses, ref):
        assert float(loss) == ref_loss
        np.testing.assert_array_equal(x.grad.numpy(), ref_dx)


def test_lent_buffer_returns_when_its_owner_is_gone():
    ws = Workspace()

    class Owner:
        pass

    a = Owner()
    buf = ws.lend("x", [4, 3], a)
    assert buf is not None and ws.lend("x", [4, 3], Owner()) is None  # lent to a live owner
    del a
    again = ws.lend("x", [4, 3], Owner())
    assert again is not None and again.data_ptr() == buf.data_ptr()
    ws.give_back("x")
    assert ws.lend("x", [5, 3], Owner()).shape == [5, 3]  # a new shape replaces the buffer
    assert ws.nbytes == 5 * 3 * 4
    assert Workspace(enabled=False).lend("x", [2], Owner()) is None


def test_gradient_accumulation_keeps_stashed_gradients():
    """A stashed micro-batch gradient lives in the gathered rows' memory: the next
    micro-batch must not be lent that memory (compared with a head that never reuses)."""
    from plsc.optim import SparseMomentum
    weights = []
    for reuse in (False, True):
        head = make_head(reuse, ratio=0.4)
        opt = SparseMomentum(0.1, momentum=0.9, weight_decay=5e-4)
        for i, (x, y) in enumerate(batches(4)):
            head(paddle.to_tensor(x), paddle.to_tensor(y)).backward()
            if i % 2 == 0:
                opt.stash(head)
            else:
                opt.step(head)
        weights.append(head.weight.numpy())
    np.testing.assert_array_equal(weights[0], weights[1])
