"""4-bit head state (`plsc.storage.int4`): the maps, packing and block scales against a float64
numpy oracle written here from the module's definition (tables, nibble order, two's
complement codes), their error bounds, unbiased stochastic writes, rows independent, the
optimizers with 4-bit state against numpy steps on the stored state, the fused update equal
to the separate one (checkpoints: test_quantized4_checkpoint.py). Every test on both kernel
sets."""
import numpy as np
import paddle
import pytest

from plsc.loss import CosFace
from plsc.nn import PartialFC
from plsc.optim import SparseAdamW, SparseMomentum
from plsc.optim.rounding import uniform_noise
from plsc.storage.int4 import Int4Rows, dequantize, quantize
from plsc.storage import name as storage_name

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets

NAMES = ["int4", "int4_log", "uint4_log"]
B = 128  # the documented block size: values sharing one scale


def rows(n=24, d=300, seed=0, positive=False):
    """float32 rows, d not a multiple of the block (a short last block), magnitudes spread
    within each block, a zero row and a row with one zero block."""
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(n, d)) * np.exp(rng.uniform(-6, 2, size=(n, d)))
    if n > 4:
        x[3] = 0.0
        x[4, B:2 * B] = 0.0
    return (np.abs(x) if positive else x).astype(np.float32)


def table(name):
    """The map's values from the module docstring, float64 then float32."""
    if name == "int4":  # linear: k / 7
        return (np.arange(-7, 8) / 7.0).astype(np.float32)
    if name == "int4_log":
        mags = 2.0 ** (-np.arange(7) / 2)
        return np.concatenate([-mags, [0.0], mags[::-1]]).astype(np.float32)
    return np.concatenate([[0.0], (2.0 ** (-np.arange(15) / 2))[::-1]]).astype(np.float32)


def oracle_scales(x):
    """[n, blocks]: max |x| of each block of B values (the last block the rest)."""
    return np.stack([np.abs(x[:, j:j + B]).max(axis=1) for j in range(0, x.shape[1], B)], 1)


def per_value(s, d):
    return np.repeat(s, B, axis=1)[:, :d]


def oracle_unpack(codes, name):
    """Table indices of packed bytes: element 2j the low nibble of byte j, 2j + 1 the high;
    the signed map's nibble a two's complement code with 0 at index 7."""
    nib = np.empty(codes.shape[:-1] + (2 * codes.shape[-1],), np.int64)
    nib[..., 0::2], nib[..., 1::2] = codes & 15, codes >> 4
    if name != "uint4_log":
        return np.where(nib >= 8, nib - 16, nib) + 7
    return nib


def oracle_index(x, name, u=None):
    """Table indices float64 numpy picks for `x` (u: stochastic noise) and the entries where
    float32 rounding of x / scale could flip the choice."""
    t = table(name).astype(np.float64)
    s = per_value(oracle_scales(x).astype(np.float64), x.shape[1])
    y = x / np.where(s > 0, s, 1)
    hi = np.clip(np.searchsorted(t, y, side="right"), 1, len(t) - 1)
    frac = (y - t[hi - 1]) / (t[hi] - t[hi - 1])
    if u is None:
        up, edge = frac > 0.5, np.abs(frac - 0.5) < 1e-4
    elif name == "int4":  # floor(7y + u): up where frac + u >= 1
        up, edge = frac + u >= 1, np.abs(frac + u - 1) < 1e-4
    else:
        up, edge = u < frac, np.abs(u - frac) < 1e-4
    idx = hi - 1 + up
    if name == "uint4_log":  # a positive value is never stored as 0
        idx = np.where((idx == 0) & (y > 0), 1, idx)
    return idx, edge


def values_of(codes, scale, name, d):
    return table(name)[oracle_unpack(codes, name)].astype(np.float64) * \
        per_value(scale.astype(np.float64), d)


@pytest.mark.parametrize("name", NAMES)
def test_nearest_codes_match_the_float64_oracle_and_the_error_bound(name):
    x = rows(positive=name == "uint4_log")
    codes, scale = quantize(paddle.to_tensor(x), name)
    codes, scale = codes.numpy(), scale.numpy()
    assert codes.dtype == np.uint8 and codes.shape == (24, 150) and scale.shape == (24, 3)
    np.testing.assert_array_equal(scale, oracle_scales(x))  # each block's largest magnitude
    want, edge = oracle_index(x, name)
    got_index = oracle_unpack(codes, name)
    assert edge.mean() < 0.01
    np.testing.assert_array_equal(got_index[~edge], want[~edge])
    assert (np.abs(got_index - want) <= 1).all()
    got = dequantize(paddle.to_tensor(codes), paddle.to_tensor(scale), name).numpy()
    np.testing.assert_allclose(got, values_of(codes, scale, name, x.shape[1]), rtol=2 ** -23,
                               atol=0)
    # The bound: half the ratio of neighbours (√2), relative, above the smallest step; below
    # it half that step (signed: 0 is a code) or the step itself (uint4_log stores it). The
    # linear map: half its step, scale / 14, everywhere.
    err = np.abs(got.astype(np.float64) - x)
    s = per_value(scale.astype(np.float64), x.shape[1])
    if name == "int4":
        assert (err <= s / 14 * (1 + 1e-5)).all() and (got[3] == 0).all()
        assert (got[4, B:2 * B] == 0).all() and not np.signbit(got[3]).any()
        return
    smallest = s * (2.0 ** -3 if name == "int4_log" else 2.0 ** -7)
    big = np.abs(x) >= smallest
    assert (err[big] <= np.abs(x)[big] * (np.sqrt(2) - 1) / 2 * (1 + 1e-5)).all()
    below = smallest / 2 if name == "int4_log" else smallest
    assert (err[~big] <= below[~big] * (1 + 1e-5)).all()
    assert (got[3] == 0).all() and (got[4, B:2 * B] == 0).all() and np.isfinite(got).all()
    assert not np.signbit(got[3]).any()  # a zero byte is +0
    if name == "uint4_log":  # the zero-point rule: a positive value is never stored as 0
        assert (~big & (x > 0)).any()
        assert (got[x > 0] > 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_stochastic_codes_match_the_oracle_and_are_neighbours(name):
    x = rows(seed=1, positive=name == "uint4_log")
    u = uniform_noise(paddle.arange(x.shape[0], dtype="int64"), x.shape[1], seed=3, step=7)
    codes, _ = quantize(paddle.to_tensor(x), name, u)
    got = oracle_unpack(codes.numpy(), name)
    want, edge = oracle_index(x, name, u.numpy().astype(np.float64))
    np.testing.assert_array_equal(got[~edge], want[~edge])
    near, _ = oracle_index(x, name)
    assert (np.abs(got - near) <= 1).all()


@pytest.mark.parametrize("name", NAMES)
def test_stochastic_writes_are_unbiased(name):
    """Over 400 draws (a new step each) the mean stored value of each element is within 4.5
    standard errors of x (a draw's spread is at most the step between x's neighbours), the
    z-scores average 0, and the mean is closer to x than rounding to nearest."""
    x = rows(n=8, d=2 * B, seed=2, positive=name == "uint4_log")
    x *= np.where(np.abs(x) == per_value(oracle_scales(x), x.shape[1]), 1, 0.999)
    t = table(name).astype(np.float64)
    s = per_value(oracle_scales(x).astype(np.float64), x.shape[1])
    y = x / np.where(s > 0, s, 1)
    hi = np.clip(np.searchsorted(t, y, side="right"), 1, len(t) - 1)
    spread = np.maximum((t[hi] - t[hi - 1]) * s, np.abs(x) * 1e-6 + 1e-45)
    ids = paddle.arange(8, dtype="int64")
    draws = 400
    total = np.zeros(x.shape)
    for step in range(draws):
        u = uniform_noise(ids, x.shape[1], seed=0, step=step)
        total += dequantize(*quantize(paddle.to_tensor(x), name, u), name).numpy()
    mean = total / draws
    z = (mean - x) / (spread / 2 / np.sqrt(draws))
    if name == "uint4_log":  # below the smallest step values are stored as it: not unbiased
        z = z[~((y > 0) & (y < 2.0 ** -7))]
    assert np.abs(z).max() < 4.5 * 1.6, np.abs(z).max()
    assert abs(z.mean()) < 4.5 / np.sqrt(z.size)
    nearest = dequantize(*quantize(paddle.to_tensor(x), name), name).numpy()
    assert np.abs(mean - x).mean() < np.abs(nearest - x).mean()


@pytest.mark.parametrize("name", NAMES)
def test_writes_touch_only_their_rows_and_each_row_alone(name):
    """Writing rows at an index leaves every other row's bytes and scales bit for bit, and a
    written row stores what quantising that row alone stores (no scale shared across rows);
    non-finite blocks read back as NaN and nothing else does."""
    x = rows(n=30, d=2 * B + 20, seed=3, positive=name == "uint4_log")
    a = Int4Rows.from_float(paddle.to_tensor(x), name)
    before = a.codes.numpy().copy(), a.scale.numpy().copy()
    index = np.array([2, 11, 17, 29])
    new = rows(n=4, d=x.shape[1], seed=4, positive=name == "uint4_log") * 1e3
    new[1, 5] = np.inf
    u = uniform_noise(paddle.to_tensor(index), x.shape[1], seed=1, step=2)
    a.write(paddle.to_tensor(index), paddle.to_tensor(new), u)
    other = np.setdiff1d(np.arange(30), index)
    np.testing.assert_array_equal(a.codes.numpy()[other], before[0][other])
    np.testing.assert_array_equal(a.scale.numpy()[other], before[1][other])
    for k, row in enumerate(index):
        alone_codes, alone_scale = quantize(paddle.to_tensor(new[k:k + 1]), name, u[k:k + 1])
        np.testing.assert_array_equal(a.codes.numpy()[row], alone_codes.numpy()[0])
        np.testing.assert_array_equal(a.scale.numpy()[row], alone_scale.numpy()[0])
    got = a.rows().numpy()
    assert np.isnan(got[11, :B]).all() and np.isfinite(got[11, B:]).all()
    assert np.isfinite(np.delete(got, 11, axis=0)).all()
    np.testing.assert_array_equal(a.take(paddle.to_tensor(index)).numpy()[[0, 2, 3]],
                                  got[index[[0, 2, 3]]])


def special_rows(name, d=2 * B):
    """Rows of every table value times a scale, their float32 neighbours, zeros of both signs
    and subnormals, in shuffled order, each block holding its largest value 1 (× scale)."""
    t = table(name)
    v = np.concatenate([t, np.nextafter(t, 2), np.nextafter(t, -2),
                        [0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40]]).astype(np.float32)
    v = np.clip(v, 0 if name == "uint4_log" else -1, 1)
    rng = np.random.RandomState(4)
    out = []
    for s in (1.0, 0.5, 3.0, 2.0 ** -20):
        row = rng.permutation(np.resize(v, d))
        row[::B] = 1.0
        out.append(row * np.float32(s))
    return np.stack(out).astype(np.float32)


@pytest.mark.parametrize("name", NAMES)
def test_table_values_and_their_neighbours_match_the_oracle(name):
    """The brackets from the bits (CPU set) and from the table (device set) on the values
    where they could differ: the table's own values (a negative one is the top of the bracket
    below it on the CPU, the bottom of the one above on the device), their neighbours, ±0 and
    subnormals, nearest and stochastic."""
    x = special_rows(name)
    u = uniform_noise(paddle.arange(x.shape[0], dtype="int64"), x.shape[1], seed=5)
    for noise in (None, u):
        codes, scale = quantize(paddle.to_tensor(x), name, noise)
        np.testing.assert_array_equal(scale.numpy(), oracle_scales(x))
        want, edge = oracle_index(x, name, None if noise is None else u.numpy())
        got = oracle_unpack(codes.numpy(), name)
        np.testing.assert_array_equal(got[~edge], want[~edge])
        exact = np.isin(x / per_value(scale.numpy(), x.shape[1]), table(name))
        assert not edge[exact].any() and exact.sum() > 40


def test_the_kernel_sets_give_the_same_bits(monkeypatch):
    """The numpy kernels (CPU set) and the Paddle ops (device set) store the same bytes and
    scales and read the same values, for both maps, nearest and stochastic: random rows, table
    values and their neighbours, a width not a multiple of the block, non-finite blocks."""
    from plsc.kernels.cpu_kernels import KERNELS_ENV
    out = {}
    for ks in ("auto", "device"):
        monkeypatch.setenv(KERNELS_ENV, ks)
        for name in NAMES:
            x = rows(n=40, d=2 * B + 2, seed=5, positive=name == "uint4_log")
            x = np.concatenate([x, special_rows(name, 2 * B + 2)])
            x[41, 3], x[42, B + 1] = np.inf, np.nan  # non-finite blocks: NaN scales, codes 0
            u = uniform_noise(paddle.arange(44, dtype="int64"), x.shape[1], seed=9)
            for noise in (None, u):
                c, s = quantize(paddle.to_tensor(x), name, noise)
                out[ks, name, noise is None] = (c.numpy(), s.numpy(),
                                                dequantize(c, s, name).numpy())
    for key in [k for k in out if k[0] == "auto"]:
        for a, b in zip(out[key], out[("device",) + key[1:]]):
            np.testing.assert_array_equal(a, b, err_msg=str(key))
        codes, scale = out[key][:2]
        assert np.isnan(scale[41, 0]) and np.isnan(scale[42, 1]) and not (codes[41, :B // 2]).any()


# ---------------------------------------------------------------- the optimizers

class StubHead:
    """What the optimizers read: a float32 weight, rank, sampled rows with their gradient."""

    def __init__(self, w):
        self.weight = paddle.create_parameter(list(w.shape), "float32")
        self.weight.set_value(w)
        self.bias, self.rank = None, 1
        self.sampled_index = self.sampled_weight = None

    sampled_rows = property(lambda self: self.sampled_index)

    def backward(self, index, gw):
        self.sampled_index = paddle.to_tensor(np.asarray(index, np.int64))
        self.sampled_weight = paddle.to_tensor(gw, stop_gradient=False)
        self.sampled_weight.grad = paddle.to_tensor(gw)

    def release_sampled_rows(self, gradients_kept=False):
        self.sampled_weight = None

    def row_gradient(self, name):
        return self.sampled_weight.grad if self.sampled_weight is not None else None

    def drop_dense_gradients(self):
        pass


def stored(opt, key):
    """float64 values of state `key` from its bytes and scales (this file's oracle)."""
    a = opt.state_dict()[f"weight.{key}"]
    return values_of(a.codes.numpy(), a.scale.numpy(), storage_name(a), a.shape[-1])


def map_bound(v, name):
    """|stored − v| a nearest write of v may make (this file's bound, per value)."""
    s = per_value(oracle_scales(v), v.shape[1]).astype(np.float64)
    if name == "int4":
        return s / 14 * (1 + 1e-5)
    smallest = s * (2.0 ** -3 if name == "int4_log" else 2.0 ** -7)
    rel = np.abs(v) * (np.sqrt(2) - 1) / 2 * (1 + 1e-5)
    return np.where(np.abs(v) >= smallest, rel, smallest * (1 + 1e-5))


@pytest.mark.parametrize("kind", ["momentum", "adamw"])
def test_steps_match_numpy_on_the_stored_state(kind):
    """Each step is numpy's float32 formula on the weight and the state as stored (read here
    from the bytes and scales); the state written is that formula's within the map's bound;
    unused rows keep their bytes; the weight after a step that read 4-bit state differs from
    the float32-state run by no more than lr·(state error), which is far below the update."""
    rng = np.random.RandomState(7)
    n, d, lr = 40, 2 * B, 0.1
    w = (rng.normal(size=(n, d)) * 0.05).astype(np.float32)
    head = StubHead(w)
    if kind == "momentum":
        opt = SparseMomentum(lr, momentum=0.9, weight_decay=5e-4, state_dtype="int4",
                             rounding="nearest")
        names = {"velocity": "int4"}
    else:
        opt = SparseAdamW(lr, weight_decay=0.01, state_dtype="int4", rounding="nearest")
        names = {"moment1": "int4_log", "moment2": "uint4_log"}
    plan = [[1, 4, 5, 9, 30], [0, 4, 9, 17, 39], [4, 5, 6]]
    steps = np.zeros(n)
    for index in plan:
        g = (rng.normal(size=(len(index), d)) * np.exp(rng.uniform(-4, 0, (len(index), d))))
        g = g.astype(np.float32)
        w0 = head.weight.numpy().astype(np.float64)[index]
        state0 = {k: stored(opt, k)[index] if opt._state else np.zeros_like(w0) for k in names}
        before = {k: (opt.state_dict()[f"weight.{k}"].codes.numpy().copy(),
                      opt.state_dict()[f"weight.{k}"].scale.numpy().copy())
                  for k in names} if opt._state else {}
        head.backward(index, g)
        opt.step(head)
        g64 = g.astype(np.float64)
        if kind == "momentum":
            v = 0.9 * state0["velocity"] + g64 + 5e-4 * w0
            want, new = w0 - lr * v, {"velocity": v}
        else:
            steps[index] += 1
            t = steps[index][:, None]
            m = 0.9 * state0["moment1"] + 0.1 * g64
            v2 = 0.999 * state0["moment2"] + 0.001 * g64 * g64
            want = w0 * (1 - lr * 0.01) - lr * (m / (1 - 0.9 ** t)) / (
                np.sqrt(v2 / (1 - 0.999 ** t)) + 1e-8)
            new = {"moment1": m, "moment2": v2}
        got = head.weight.numpy()[index]
        # float32 arithmetic on terms of size |w| + lr·|update|: a few ulps of them
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * (np.abs(w0).max() + lr))
        for key, value in new.items():
            err = np.abs(stored(opt, key)[index] - value)
            assert (err <= map_bound(value, names[key]) + 1e-12).all(), key
            assert err.max() > 0  # 4 bits show: the bound is what is tested
        other = np.setdiff1d(np.arange(n), index)
        for key, (codes, scale) in before.items():
            np.testing.assert_array_equal(
                opt.state_dict()[f"weight.{key}"].codes.numpy()[other], codes[other])
            np.testing.assert_array_equal(
                opt.state_dict()[f"weight.{key}"].scale.numpy()[other], scale[other])
    assert isinstance(opt.state_dict()[f"weight.{list(names)[0]}"], Int4Rows)
    assert {storage_name(opt.state_dict()[f"weight.{k}"]) for k in names} == set(names.values())


def _partial_fc_run(opt_cls, fused, steps, sub_centers=1, chunk="auto", ratio=0.3,
                    state=None, seed=2):
    """(head, optimizer) after `steps` steps of a PartialFC (int8 centres, 4-bit state)."""
    paddle.seed(0)
    head = PartialFC(2 * B, 60, CosFace(30.0, 0.35), sample_ratio=ratio, param_dtype="int8",
                     seed=1, sub_centers=sub_centers, chunk_size=chunk)
    opt = opt_cls(0.1, state_dtype="int4", seed=seed)
    if state is not None:
        head_state, opt_state = state
        head.weight.codes.set_value(head_state[0])
        head.weight.scale.set_value(head_state[1])
        head.sample_step.fill_(int(head_state[2]))  # the sampler's step, saved with the model
        opt.set_state_dict(opt_state)
    rng = np.random.RandomState(0)
    batches = [(rng.normal(size=(12, 2 * B)).astype(np.float32), rng.randint(0, 60, 12))
               for _ in range(4)]
    for x, y in batches[steps[0]:steps[1]]:
        x, y = paddle.to_tensor(x, stop_gradient=False), paddle.to_tensor(y)
        if fused:
            head.row_update = opt.fused_update(head)
            head(x, y).backward()
            opt.end_fused_step(head)
        else:
            head(x, y).backward()
            opt.step(head)
    return head, opt


def _bits(head, opt):
    out = {"w.codes": head.weight.codes.numpy(), "w.scale": head.weight.scale.numpy()}
    for k, v in opt.state_dict().items():
        out[k] = (v.codes.numpy(), v.scale.numpy()) if isinstance(v, Int4Rows) else v.numpy()
    return out


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        for x, y in zip(*(v if isinstance(v, tuple) else (v,) for v in (a[k], b[k]))):
            np.testing.assert_array_equal(x, y, err_msg=k)


@pytest.mark.parametrize("opt_cls", [SparseMomentum, SparseAdamW])
@pytest.mark.parametrize("sub_centers,chunk,ratio", [(1, "auto", 0.3), (2, 16, 0.3),
                                                    (1, "auto", 1.0), (1, 16, 1.0)])
def test_fused_update_equals_separate_and_writes_4_bit_state(opt_cls, sub_centers, chunk,
                                                               ratio):
    """int8 centres and 4-bit state, Partial FC and dense, sub-centres and a chunked head: the
    update inside the backward gives the separate update's bytes and scales bit for bit, and
    the state is 4-bit rows that moved."""
    separate = _bits(*_partial_fc_run(opt_cls, False, (0, 3), sub_centers, chunk, ratio))
    fused_head, fused_opt = _partial_fc_run(opt_cls, True, (0, 3), sub_centers, chunk, ratio)
    _assert_same(separate, _bits(fused_head, fused_opt))
    state = fused_opt.state_dict()
    for key in opt_cls.state_names:
        a = state[f"weight.{key}"]
        assert isinstance(a, Int4Rows) and a.shape == list(fused_head.weight.shape)
        assert (a.scale.numpy() > 0).any()
