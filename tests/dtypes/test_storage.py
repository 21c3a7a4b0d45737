"""plsc.storage: one interface to a head array whatever its storage, against numpy oracles
(float32 as it is, 16 bits upcast exactly and written to nearest even, 8 bits through the
maps' own oracle in dtypes/test_quantized.py), on both kernel sets."""
import numpy as np
import paddle
import pytest

from plsc import storage
from plsc.storage.int8 import Int8Rows, dequantize
from dtypes.test_rounding import rne

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets

N, D = 50, 8


def _array(dtype, x):
    if dtype == "int8":
        return Int8Rows.from_float(paddle.to_tensor(x))
    return paddle.to_tensor(x).astype(dtype)


def _values(t):
    """float32 values of a head array, read without plsc.storage."""
    if isinstance(t, Int8Rows):
        return dequantize(t.codes, t.scale, t.map.name).numpy()
    return t.astype("float32").numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_read_take_and_put_touch_only_their_rows(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal([N, D]).astype(np.float32)
    t = _array(dtype, x)
    before = _values(t)
    assert storage.name(t) == dtype
    np.testing.assert_array_equal(storage.read(t).numpy(), before)
    np.testing.assert_array_equal(storage.read(t, 3, 9).numpy(), before[3:9])
    index = np.array([7, 2, 40, 2], np.int64)  # a repeated row, written with equal values
    np.testing.assert_array_equal(storage.take(t, paddle.to_tensor(index)).numpy(),
                                  before[index])
    new = rng.standard_normal([4, D]).astype(np.float32)
    new[3] = new[1]
    storage.put(t, paddle.to_tensor(index), paddle.to_tensor(new))
    after = _values(t)
    others = np.setdiff1d(np.arange(N), index)
    np.testing.assert_array_equal(after[others], before[others])
    if dtype == "int8":  # the maps' error bound: half a step of the row's largest value
        bound = np.abs(new).max(axis=1, keepdims=True) / 254 * (1 + 1e-6)
        assert np.all(np.abs(after[index] - new) <= bound)
    else:
        np.testing.assert_array_equal(after[index], new if dtype == "float32" else rne(new, dtype))
    storage.put(t, 10, paddle.to_tensor(new[:2]))  # a block of rows from a start
    np.testing.assert_array_equal(_values(t)[10:12], _values(t)[[7, 2]])  # stored alike


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_put_with_keep_leaves_the_stored_bits(dtype):
    x = np.random.default_rng(1).standard_normal([N, D]).astype(np.float32)
    t = _array(dtype, x)
    stored = ([t.codes.numpy().copy(), t.scale.numpy().copy()] if dtype == "int8"
              else [t.numpy().copy()])
    index = paddle.to_tensor(np.array([1, 5, 30], np.int64))
    storage.put(t, index, paddle.full([3, D], 7.0), keep=paddle.to_tensor(True))
    storage.put(t, 20, paddle.full([2, D], 7.0), keep=paddle.to_tensor(True))
    now = [t.codes.numpy(), t.scale.numpy()] if dtype == "int8" else [t.numpy()]
    for a, b in zip(now, stored):
        np.testing.assert_array_equal(a, b)
    storage.put(t, index, paddle.full([3, D], 7.0), keep=paddle.to_tensor(False))
    np.testing.assert_allclose(_values(t)[[1, 5, 30]], 7.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_put_stores_values_already_in_the_storage_as_they_are(dtype):
    """16-bit values (rounded by the caller) and their bits as int32 pairs (the device set's
    batched rounding) are stored bit for bit; keep and a start row need float32 values."""
    rng = np.random.default_rng(2)
    t = _array(dtype, rng.standard_normal([N, D]).astype(np.float32))
    new = paddle.to_tensor(rng.standard_normal([3, D]).astype(np.float32)).astype(dtype)
    bits = new.numpy().view(np.uint16)
    storage.put(t, paddle.to_tensor(np.array([4, 9, 11], np.int64)), new)
    storage.put(t, paddle.to_tensor(np.array([20, 0, 33], np.int64)), new.view("int32"))
    stored = t.numpy().view(np.uint16)
    np.testing.assert_array_equal(stored[[4, 9, 11]], bits)
    np.testing.assert_array_equal(stored[[20, 0, 33]], bits)
    with pytest.raises(ValueError, match="int32 pairs"):
        storage.put(t, 3, new.view("int32"))
    with pytest.raises(ValueError, match="keep needs float32"):
        storage.put(t, paddle.to_tensor(np.array([1, 2, 3], np.int64)), new,
                    keep=paddle.to_tensor(True))


def test_slab_rows_from_the_budget_of_the_kernel_set(kernels):
    t = paddle.zeros([4, 512])
    expected = (32 << 20) // 2048 if kernels == "cpu" else (256 << 20) // 2048
    assert storage.slab_rows(512, t) == expected
    assert storage.slab_rows(512, t, budget=4096) == 2
    assert storage.slab_rows(10 ** 9, t) == 1


def test_zeros_and_the_dtype_names():
    assert storage.HEAD_DTYPES == ("float32", "bfloat16", "float16", "int8")
    z = storage.zeros([3, 4], "int8", "uint8_log")
    assert isinstance(z, Int8Rows) and storage.name(z) == "uint8_log"
    assert storage.name(storage.zeros([3], "int8")) == "float32"  # a value a row
    assert storage.name(storage.zeros([3, 4], "bfloat16")) == "bfloat16"
    assert storage.STATE_DTYPES == storage.HEAD_DTYPES + ("int4",)
    z4 = storage.zeros([3, 4], "int4", "uint4_log")
    assert type(z4).__name__ == "Int4Rows" and storage.name(z4) == "uint4_log"
    assert storage.name(storage.zeros([3, 4], "int4")) == "int4"
    assert storage.name(storage.zeros([3], "int4")) == "float32"  # a value a row
    with pytest.raises(ValueError, match="int2"):
        storage.zeros([3, 4], "int2")
    assert storage.all_rows_finite([z, paddle.ones([2, 2], "float16")])
    bad = paddle.ones([2, 2], "bfloat16")
    bad[1, 1] = float("inf")
    assert not storage.all_rows_finite([z, bad])
