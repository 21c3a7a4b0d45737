"""What a head step keeps beside its arrays: with the update inside the backward, Partial FC's
sampled rows of a 16- or 8-bit weight are gathered in their storage (no float32 copy), and the
chunked path keeps no `[C_local]` array of row norms; the results are those of the float32
rows (checked against numpy and the dense path)."""
import plsc  # noqa: F401  -- before Paddle
import numpy as np
import paddle
import pytest

from plsc.loss import ArcFace
from plsc.nn import PartialFC
from plsc.optim import SparseMomentum

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets

D, B, C = 16, 12, 60


def _batch(seed=5):
    rng = np.random.RandomState(seed)
    x = paddle.to_tensor(rng.normal(size=(B, D)).astype("float32"), stop_gradient=False)
    return x, paddle.to_tensor(rng.randint(0, C, B).astype("int64"))


def _host_bits(t):
    a = t.numpy()
    return a.view(np.uint16) if a.dtype.itemsize == 2 and a.dtype.kind == "f" else a


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_fused_partial_fc_gathers_rows_in_storage(dtype):
    head = PartialFC(D, C, ArcFace(), sample_ratio=0.5, seed=1, param_dtype=dtype)
    opt = SparseMomentum(0.1, momentum=0.9)
    x, y = _batch()
    before = ((head.weight.codes.numpy(), head.weight.scale.numpy()) if dtype == "int8"
              else _host_bits(head.weight))
    seen = {}

    def update(lo, hi, weight_grad, bias_grad):  # records the gathered rows, then updates
        seen.setdefault("rows", head.sampled_weight)
        fused(lo, hi, weight_grad, bias_grad)

    fused = opt.fused_update(head)
    head.row_update = update
    head(x, y).backward()
    rows, index = seen["rows"], head.sampled_rows.numpy()
    if dtype == "int8":  # the stored codes and scales of the sampled rows, not float32 values
        np.testing.assert_array_equal(rows.codes.numpy(), before[0][index])
        np.testing.assert_array_equal(rows.scale.numpy(), before[1][index])
    else:
        assert rows.dtype == paddle.bfloat16
        np.testing.assert_array_equal(_host_bits(rows), before[index])
    opt.end_fused_step(head)
    assert head.sampled_weight is None


def test_chunked_step_matches_dense_without_a_norm_array():
    """The chunked path's block-wise 1/|W| gives the dense path's loss and gradients."""
    rng = np.random.RandomState(2)
    w = rng.normal(size=(C, D)).astype("float32")
    out = {}
    for chunk in (0, 7):
        head = PartialFC(D, C, ArcFace(), chunk_size=chunk)
        head.weight.set_value(w)
        x, y = _batch()
        loss = head(x, y)
        loss.backward()
        out[chunk] = (float(loss), x.grad.numpy(), head.weight.grad.numpy())
    np.testing.assert_allclose(out[7][0], out[0][0], rtol=1e-6)
    np.testing.assert_allclose(out[7][1], out[0][1], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(out[7][2], out[0][2], rtol=1e-5, atol=2e-5)


def test_a_narrower_block_borrows_the_kept_buffer():
    """One buffer per name, the largest asked for: a smaller request is a view of its first
    elements (no second buffer kept), a larger one replaces it."""
    from plsc.nn import Workspace
    ws, owner = Workspace(), type("Owner", (), {})()
    full = ws.lend("logits", [4, 10], owner)
    ws.give_back("logits")
    part = ws.lend("logits", [4, 6], owner)
    assert part.shape == [4, 6] and part.data_ptr() == full.data_ptr()
    assert ws.nbytes == 4 * 10 * 4
    part.copy_(paddle.arange(24, dtype="float32").reshape([4, 6]), False)
    np.testing.assert_array_equal(full.numpy().reshape(-1)[:24], np.arange(24))
    ws.give_back("logits")
    assert ws.lend("logits", [5, 10], owner).shape == [5, 10] and ws.nbytes == 5 * 10 * 4
