"""Rounding into 16-bit storage against numpy: the stored value is always one of the two
neighbours computed here, stochastic rounding is unbiased within a stated statistical bound,
its bits are a pure function of (seed, stream, step, rank, row, column), and "nearest" is
round-to-nearest-even."""
import numpy as np
import paddle
import pytest

from plsc.optim.rounding import round_to

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets

DTYPES = ["bfloat16", "float16"]


def stored(t):
    """A 16-bit tensor as float32 numpy (the upcast is exact)."""
    return t.astype("float32").numpy()


def bf16_rne(x):
    """numpy round-to-nearest-even of float32 to bfloat16, as float32 (finite x)."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def rne(x, dtype):
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore"):
        return bf16_rne(x) if dtype == "bfloat16" else x.astype(np.float16).astype(np.float32)


def neighbours(x, dtype):
    """(lo, hi): the largest value of `dtype` <= x and the smallest >= x (inf past the top;
    for bfloat16 the top is 2^128, so lo is the largest finite value there)."""
    x = np.asarray(x, np.float32)
    if dtype == "bfloat16":
        b = x.view(np.uint32)
        toward0 = (b & 0xFFFF0000).view(np.float32)
        away = np.where(b & 0xFFFF, (b & 0xFFFF0000) + 0x10000, b)
        away = away.astype(np.uint32).view(np.float32)
        neg = x < 0
        return np.where(neg, away, toward0), np.where(neg, toward0, away)
    r = x.astype(np.float16)
    up = r.astype(np.float64) >= x
    lo = np.where(up & (r.astype(np.float64) > x), np.nextafter(r, np.float16(-np.inf)), r)
    hi = np.where(~up, np.nextafter(r, np.float16(np.inf)), r)
    return lo.astype(np.float32), hi.astype(np.float32)


VALUES = {
    "bfloat16": [1.0 + 2 ** -9, -(1.0 + 2 ** -9), 1.0 + 3 * 2 ** -10, 0.1, -0.1, 1e-3, -3.14159,
                 1e30, -7e-30, 1e-40, -3e-39, 3.3e38, 1.5, -2.0, 0.0, 1.0 + 2 ** -8, 12345.678],
    "float16": [1.0 + 2 ** -12, -(1.0 + 3 * 2 ** -12), 0.1, -0.3, 1e-3, 7e-5, -6.5e-5, 3e-6,
                -1e-7, 2.0 ** -26, 3e-9, 6e4, -6.1e4, 65000.0, 0.5, 2048.0, -3.0, 0.0],
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(dtype):
    v = np.array(VALUES[dtype], np.float32)
    rows, steps = 64, 40
    x = paddle.to_tensor(np.tile(v, (rows, 1)))
    lo, hi = neighbours(v, dtype)
    draws = np.stack([stored(round_to(x, dtype, step=s, seed=7)) for s in range(steps)])
    up = draws == hi
    assert np.all((draws == lo) | up), "every stored value is one of the two neighbours"
    # Fraction rounded up vs p = (x - lo) / (hi - lo), over n draws that are independent
    # across steps and pairwise independent across rows: 5 standard errors of a Bernoulli
    # mean, plus float16's documented bias below 2^-14 (x's bits past 2^-13 of an ulp).
    n = rows * steps
    exact = hi == lo
    gap = np.where(exact, 1.0, hi.astype(np.float64) - lo)
    p = np.where(exact, 0.0, (v.astype(np.float64) - lo) / gap)
    bias = np.where((dtype == "float16") & (np.abs(v) < 2 ** -14), 2.0 ** -13, 0.0)
    frac = up.reshape(n, -1).mean(0)
    frac = np.where(exact, 0.0, frac)
    bound = 5 * np.sqrt(p * (1 - p) / n) + bias + 1e-12
    assert np.all(np.abs(frac - p) <= bound), (v, frac, p, bound)
    # In value terms: the mean of the stored values is x within the same bound times the gap.
    mean = draws.astype(np.float64).reshape(n, -1).mean(0)
    assert np.all(np.abs(mean - v) <= bound * gap * (1 + 1e-9))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_random_bit_counts(dtype):
    """x one float32 ulp above 1 rounds up with p = 2^-16 (bfloat16) or 2^-13 (float16): only
    if all 16 (13) random bits are used. Over n draws the count of ups is Poisson(n·p);
    n·p = 16 here, and [3, 40] holds it with probability 1 - 1e-5."""
    p = {"bfloat16": 2.0 ** -16, "float16": 2.0 ** -13}[dtype]
    shape = [1024, 1024] if dtype == "bfloat16" else [256, 512]
    x = paddle.full(shape, 1.0 + 2 ** -23, dtype="float32")
    ups = int((stored(round_to(x, dtype, seed=1)) > 1.0).sum())
    assert 3 <= ups <= 40, (ups, x.size * p)


def test_bfloat16_past_the_largest_finite_value_goes_to_inf_in_proportion():
    top = float(np.array([0x7F7F0000], np.uint32).view(np.float32)[0])  # largest finite bf16
    x_val = np.float32(3.4e38)
    p = (float(x_val) - top) / (2.0 ** 128 - top)
    x = paddle.to_tensor(np.full([256, 16], x_val, np.float32))
    draws = np.stack([stored(round_to(x, "bfloat16", step=s)) for s in range(8)])
    assert np.all((draws == top) | (draws == np.inf))
    n = draws.size
    assert abs((draws == np.inf).mean() - p) <= 5 * np.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["stochastic", "nearest"])
def test_specials_are_kept(dtype, mode):
    nan_payloads = np.array([0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001,
                             0xFF80FFFF, 0x7FBFFFFF], np.uint32).view(np.float32)
    x = np.concatenate([nan_payloads, np.array([np.inf, -np.inf, 0.0, -0.0], np.float32)])
    x = np.tile(x, (32, 1))
    for step in range(4):
        got = stored(round_to(paddle.to_tensor(x), dtype, mode, step=step))
        assert np.isnan(got[:, :7]).all()
        np.testing.assert_array_equal(got[:, 7:9], x[:, 7:9])
        assert not got[:, 9:].any()
        if mode == "stochastic" and dtype == "bfloat16":  # float16 stores zeros as +0
            np.testing.assert_array_equal(np.signbit(got[:, 9:]), np.signbit(x[:, 9:]))


def _mixed_values(seed, shape):
    """float32 values at every scale, both signs, from fp16-subnormal size to near the top."""
    rng = np.random.default_rng(seed)
    mag = np.exp(rng.uniform(np.log(1e-9), np.log(6e4), shape))
    return (mag * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nearest_is_round_to_nearest_even(dtype):
    x = _mixed_values(1, [300, 64])
    # ties and values that Paddle 3.3's CPU float16 cast gets wrong (|x| in (2^-89, 2^-77))
    ties = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 2 ** -25,
                     3 * 2 ** -25, 65520.0, -65520.0, 1e-25, -3e-26, 5e-27, 2 ** -26, 1e-45],
                    np.float32)
    x[0, :ties.size] = ties
    patterns = np.random.default_rng(2).integers(0, 2 ** 32, [60, 64], dtype=np.uint64)
    x[-60:] = patterns.astype(np.uint32).view(np.float32)  # every exponent
    x[~np.isfinite(x)] = 1.0
    got = stored(round_to(paddle.to_tensor(x), dtype, "nearest"))
    np.testing.assert_array_equal(got, rne(x, dtype))  # -0 == +0 here
    if dtype == "bfloat16":  # and it is what Paddle's cast does
        np.testing.assert_array_equal(got, stored(paddle.to_tensor(x).astype(dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bits_are_a_function_of_seed_step_rank_stream_and_row(dtype):
    # Values halfway between neighbours: each draw is a fair coin per element.
    half = {"bfloat16": 1.0 + 2 ** -8, "float16": 1.0 + 2 ** -11}[dtype]
    x = paddle.to_tensor(np.full([128, 32], half, np.float32))
    rows = paddle.to_tensor(np.arange(1000, 1128), dtype="int64")
    base = dict(seed=3, step=5, rank=1, rows=rows, stream=11)
    ref = stored(round_to(x, dtype, **base))
    np.testing.assert_array_equal(stored(round_to(x, dtype, **base)), ref)  # repeats
    assert 0.4 < (ref > half).mean() < 0.6
    for change in [dict(seed=4), dict(step=6), dict(rank=0), dict(stream=12),
                   dict(rows=rows + 128)]:
        other = stored(round_to(x, dtype, **dict(base, **change)))
        assert 0.4 < (other != ref).mean() < 0.6, change  # independent coins differ half the time
    # a row's bits follow its index, not its position: permuted rows, permuted bits
    perm = np.random.default_rng(0).permutation(128)
    x_mixed = _mixed_values(2, [128, 32])
    full = stored(round_to(paddle.to_tensor(x_mixed), dtype, **base))
    again = stored(round_to(paddle.to_tensor(x_mixed[perm]), dtype,
                            **dict(base, rows=paddle.to_tensor(perm + 1000, dtype="int64"))))
    np.testing.assert_array_equal(again, full[perm])


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunking_does_not_change_the_bits(dtype):
    x = _mixed_values(3, [200, 24])
    rows = np.sort(np.random.default_rng(1).choice(10 ** 6, 200, replace=False))
    kw = dict(seed=9, step=2, rank=3, stream=1)
    whole = stored(round_to(paddle.to_tensor(x), dtype, rows=paddle.to_tensor(rows), **kw))
    parts = [stored(round_to(paddle.to_tensor(x[a:b]), dtype, rows=paddle.to_tensor(rows[a:b]),
                             **kw)) for a, b in [(0, 1), (1, 77), (77, 200)]]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    # without `rows`, rows are 0..r-1
    np.testing.assert_array_equal(
        stored(round_to(paddle.to_tensor(x), dtype, **kw)),
        stored(round_to(paddle.to_tensor(x), dtype, rows=paddle.arange(200, dtype="int64"), **kw)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_shapes_and_float32(dtype):
    x = paddle.to_tensor(_mixed_values(4, [10, 3, 4]))
    out = round_to(x, dtype)
    assert out.dtype == getattr(paddle, dtype) and list(out.shape) == [10, 3, 4]
    lo, hi = neighbours(x.numpy(), dtype)
    got = stored(out)
    assert np.all((got == lo) | (got == hi))
    bias = paddle.to_tensor(_mixed_values(5, [7]))
    got = stored(round_to(bias, dtype, step=1))
    lo, hi = neighbours(bias.numpy(), dtype)
    assert np.all((got == lo) | (got == hi))
    assert round_to(x, "float32") is x
    assert round_to(paddle.zeros([0, 4]), dtype).shape == [0, 4]
    with pytest.raises(TypeError):
        round_to(x.astype("float64"), dtype)
    with pytest.raises(ValueError):
        round_to(x, dtype, mode="up")


@pytest.mark.parametrize("step", [3, 1023, 1024, 2500])  # the keys come 1,024 steps a table
def test_batched_bits_are_round_tos_at_every_step(step):
    """`BitsBatch` (the device set's optimizer writes: several arrays' bits in one pass, its
    hash keys sliced from a table of steps) rounds each array as `round_to` does alone."""
    from plsc.optim.rounding import BitsBatch, round_stacked
    rng = np.random.default_rng(step)
    x = paddle.to_tensor(rng.standard_normal([5, 6]).astype(np.float32))
    rows = paddle.to_tensor(rng.choice(1000, 5, replace=False).astype(np.int64))
    streams = [11, 22]
    batch = BitsBatch(7, step, 2, rows, 6, {s: "bfloat16" for s in streams})
    got = round_stacked(paddle.stack([x, x * 3]), "bfloat16", batch.stacked(streams))
    for k, s in enumerate(streams):
        want = round_to(x * (1 + 2 * k), "bfloat16", seed=7, step=step, rank=2, rows=rows,
                        stream=s)
        np.testing.assert_array_equal(got[k].view("int16").numpy(), want.view("int16").numpy())
