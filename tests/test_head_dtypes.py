"""16-bit class-centre storage and the fused optimizer update, in one process (world size 1).

The checks are tests/head_ranks.py's, which test_head_distributed.py runs on 2, 3 and 4 ranks:
a bfloat16/float16 head against the float32 head holding the same rounded values (and the
float64 oracle), and the optimizer applied inside the backward against `backward(); step()`
bit for bit.
"""
import numpy as np
import paddle
import pytest

from head_ranks import (_bits, check_dtype_vs_float32, check_fused_vs_separate, dtype_case_name,
                        dtype_cases, fused_case_name, fused_cases, fused_failures, margins,
                        rounded)
from oracles import make_case, rel_err
from plsc.loss import ArcFace, Softmax
from plsc.nn import PartialFC
from plsc.optim import SparseAdamW, SparseMomentum


@pytest.mark.parametrize("dtype,margin,classes,ratio,chunk", dtype_cases(),
                         ids=[dtype_case_name(*c) for c in dtype_cases()])
def test_16_bit_head_matches_float32_head(dtype, margin, classes, ratio, chunk):
    errs = check_dtype_vs_float32(margins()[margin], classes, ratio, chunk, dtype)
    for key, (err, allowed) in errs.items():
        assert err <= allowed, (key, err, allowed)


@pytest.mark.parametrize("opt,margin,classes,ratio,chunk,dtype", fused_cases(),
                         ids=[fused_case_name(*c) for c in fused_cases()])
def test_fused_update_equals_separate_bit_for_bit(opt, margin, classes, ratio, chunk, dtype):
    result = check_fused_vs_separate(opt, margins()[margin], classes, ratio, chunk, dtype)
    assert len(result["weight"]) == 1 and "fused_left_a_gradient" in result
    assert not fused_failures(result), fused_failures(result)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_storage_dtype_of_parameters_and_gradients(dtype):
    """Weight and bias stored in `dtype`; the embedding gradient and Partial FC's gathered rows
    (and their gradients) are float32 whatever the storage."""
    head = PartialFC(16, 40, Softmax(), sample_ratio=0.5, param_dtype=dtype)
    assert head.weight.dtype == getattr(paddle, dtype) == head.bias.dtype
    assert float(head.weight.astype("float32").abs().max()) > 0  # initialised, not zeros
    x = paddle.randn([6, 16])
    x.stop_gradient = False
    head(x, paddle.arange(6, dtype="int64")).backward()
    assert x.grad.dtype == paddle.float32
    assert head.sampled_weight.dtype == paddle.float32 == head.sampled_weight.grad.dtype
    assert head.sampled_bias.grad.dtype == paddle.float32
    with pytest.raises(ValueError, match="param_dtype"):
        PartialFC(16, 40, param_dtype="float64")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_16_bit_head_trains_several_steps(dtype, ratio):
    """Steps in a row with 16-bit storage, the separate and the fused update (Partial FC
    reuses its gathered-rows buffer from step to step)."""
    for fused in (False, True):
        head = PartialFC(16, 40, Softmax(), sample_ratio=ratio, param_dtype=dtype, chunk_size=7)
        opt = SparseMomentum(0.1, momentum=0.9)
        w0 = _bits(head.weight).copy()
        for _ in range(3):
            if fused:
                head.row_update = opt.fused_update(head)
            loss = head(paddle.randn([6, 16]), paddle.randint(0, 40, [6]))
            loss.backward()
            if fused:
                assert head.weight.grad is None and head.bias.grad is None
                opt.end_fused_step(head)
            else:
                opt.step(head)
        assert np.isfinite(float(loss)) and not np.array_equal(_bits(head.weight), w0)
        assert head.weight.dtype == getattr(paddle, dtype)


@pytest.mark.parametrize("opt_cls", [SparseMomentum, SparseAdamW])
def test_dense_16_bit_fused_leaves_no_gradient_and_is_close_to_separate(opt_cls):
    """Dense bfloat16 head: the fused step leaves no gradient and lands within a few bfloat16
    ulps of the separate step (not equal: there Paddle rounds the gradient to bfloat16)."""
    margin = ArcFace()
    x, y, w, _ = make_case(seed=3, n=8, d=16, num_classes=23, margin=margin)
    w = rounded(w, "bfloat16")
    out = []
    for fused in (True, False):
        head = PartialFC(16, 23, margin, param_dtype="bfloat16")
        head.weight.set_value(paddle.to_tensor(w).astype("bfloat16"))
        opt = opt_cls(0.01, rounding="nearest")
        if fused:
            head.row_update = opt.fused_update(head)
        head(paddle.to_tensor(x), paddle.to_tensor(y)).backward()
        if fused:
            assert head.weight.grad is None
            opt.end_fused_step(head)
        else:
            assert head.weight.grad.dtype == paddle.bfloat16
            opt.step(head)
        out.append(head.weight.astype("float32").numpy())
    assert not np.array_equal(out[0], w)
    assert rel_err(out[0], out[1]) <= 2.0 ** -6
