"""The sparse-row optimizers give the same bits on both kernel sets (`PLSC_KERNELS`): the CPU
set (numpy kernels, chunks of 1,024 rows, host-side finiteness, `unique` merge) is the oracle,
itself checked against numpy in dtypes/test_optim.py and dtypes/test_quantized.py; the device
set (Paddle ops, one slab, finiteness on the device, a sorted merge) must match it bit for
bit: every update is the same float32 elementwise operations on each row, and the random bits
are the same function of (seed, stream, step, rank, row, column). Steps: sampled rows, all rows, two accumulated
micro-batches with shared rows, a fused update with a non-finite slab; the weight and its
state in one storage (the device set rounds their rows together) or in two (4-bit state
too)."""
import numpy as np
import paddle
import pytest

from plsc.kernels.cpu_kernels import KERNELS_ENV
from plsc.optim import SparseAdamW, SparseMomentum
from plsc.storage.int8 import Int8Rows
from dtypes.test_optim import StubHead

N, D = 3000, 8  # more rows than a CPU-set chunk (1,024): the device set's one slab differs
OPTS = {"momentum": (SparseMomentum, dict(learning_rate=0.1, momentum=0.9, weight_decay=1e-3)),
        "adamw": (SparseAdamW, dict(learning_rate=0.01, weight_decay=1e-2))}


def _bits(t):
    if isinstance(t, Int8Rows):  # 8 bits, or 4 (`Int4Rows`): bytes and scales
        return np.concatenate([t.codes.numpy().view(np.uint8).reshape(-1),
                               t.scale.numpy().view(np.uint8).reshape(-1)])
    return np.ascontiguousarray(t.numpy()).reshape(-1).view(np.uint8)


def _run(kind, dtype, rounding):
    dtype, _, state_dtype = dtype.partition("+")  # "weight+state": the state in another storage
    rng = np.random.default_rng(5)
    w = (rng.standard_normal([N, D]) * 0.05).astype(np.float32)
    b = (rng.standard_normal([N]) * 0.05).astype(np.float32)
    head = StubHead(w, b, "float32" if dtype == "int8" else dtype, rank=1)
    if dtype == "int8":
        head.weight = Int8Rows.from_float(paddle.to_tensor(w))
    cls, kw = OPTS[kind]
    opt = cls(rounding=rounding, seed=3, state_dtype=state_dtype or None, **kw)

    def g(k):
        return ((rng.standard_normal([k, D]) * 1e-2).astype(np.float32),
                (rng.standard_normal([k]) * 1e-2).astype(np.float32))
    index = np.sort(rng.choice(N, 2000, replace=False))
    head.backward(index, *g(2000))
    opt.step(head)
    if dtype != "int8":  # all rows (an 8-bit weight has no dense gradient)
        head.backward(None, *g(N))
        opt.step(head)
    for part in (rng.choice(N, 1500, replace=False), rng.choice(N, 1200, replace=False)):
        head.backward(part, *g(len(part)))  # micro-batches sharing rows: merged
        opt.stash(head)
    opt.step(head)
    index = np.sort(rng.choice(N, 2500, replace=False))
    gw, gb = g(2500)
    gw[1800, 3] = np.nan  # the second slab is not finite: its rows stay as they were
    head.backward(index, gw, gb)
    update = opt.fused_update(head)
    update(0, 1500, paddle.to_tensor(gw[:1500]), paddle.to_tensor(gb[:1500]))
    update(1500, 2500, paddle.to_tensor(gw[1500:]), paddle.to_tensor(gb[1500:]))
    assert (opt.fused_applied, opt.fused_skipped) == (1, 1)
    assert not bool(opt.fused_finite())
    opt.end_fused_step(head, applied=opt.fused_applied > 0)
    arrays = {"weight": head.weight, "bias": head.bias}
    arrays.update(opt.state_dict())
    return {k: _bits(v) for k, v in arrays.items()}


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8",
                                   "bfloat16+float16", "bfloat16+int8", "int8+int4",
                                   "bfloat16+int4"])
@pytest.mark.parametrize("kind", list(OPTS))
def test_device_set_gives_the_cpu_sets_bits(kind, dtype, rounding, monkeypatch):
    if dtype == "float32" and rounding == "nearest":
        pytest.skip("float32 is never rounded")
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    cpu = _run(kind, dtype, rounding)
    monkeypatch.setenv(KERNELS_ENV, "device")
    device = _run(kind, dtype, rounding)
    assert cpu.keys() == device.keys()
    for k in cpu:
        np.testing.assert_array_equal(device[k], cpu[k], err_msg=k)
