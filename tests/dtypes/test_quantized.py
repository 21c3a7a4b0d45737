"""8-bit head arrays (`plsc.storage.int8`): the maps against numpy oracles written here, error
bounds, unbiased stochastic writes, the optimizers' updates leaving other rows bit for bit, and
an int8 head against the float64 dense oracle on the unquantised centres within the bound the
quantisation allows. The head against the float32 head on the stored values (all paths, 1 to 4
ranks) and the fused update against the separate one are tests/head_ranks.py's cases."""
import numpy as np
import paddle
import pytest

from oracles import dense_reference
from plsc.loss import CosFace
from plsc.nn import PartialFC
from plsc.optim import SparseAdamW, SparseMomentum
from plsc.optim.rounding import uniform_noise
from plsc.storage.int8 import Int8Rows, dequantize, quantize
from plsc.storage import name as storage_name, read as rows_f32
from plsc.nn.parallel_softmax import parallel_softmax_cross_entropy

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets


def rows(n=64, d=48, seed=0, positive=False):
    """float32 rows with a wide range of magnitudes within each row (and a zero row)."""
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(n, d)) * np.exp(rng.uniform(-12, 3, size=(n, d)))
    if n > 3:
        x[3] = 0.0
    if n > 6:
        x[5, :] = rng.normal(size=d) * 1e-30  # tiny, still normal float32
        x[6, :3] = np.abs(x[6]).max() * np.array([1e-11, -1e-13, 3e-10])  # below 2^-31.75
    return (np.abs(x) if positive else x).astype(np.float32)


def table(name):
    """The maps' values, from their definition in the docstring (float64, then float32)."""
    k = np.arange(256, dtype=np.float64)
    if name == "int8_log":
        mags = 2.0 ** (-k[:126] / 8)
        return np.concatenate([-mags, [0.0], mags[::-1]]).astype(np.float32), -126
    return np.concatenate([[0.0], (2.0 ** (-k[:255] / 8))[::-1]]).astype(np.float32), 0


def oracle_codes(x, name, u=None):
    """Codes numpy computes for float32 `x` (u: stochastic noise), and the entries where a
    last-ulp difference of x/scale could flip the choice (ties)."""
    absmax = np.abs(x).max(axis=1, keepdims=True)
    y = x / np.where(absmax > 0, absmax, 1)
    if name == "int8":
        z = y.astype(np.float64) * 127
        if u is None:
            code, edge = np.round(z), np.abs(np.abs(z - np.floor(z)) - 0.5) < 1e-4
        else:
            v = z + u
            code, edge = np.floor(v), np.abs(v - np.round(v)) < 1e-4
        return np.clip(code, -127, 127), edge
    t, first = table(name)
    hi = np.clip(np.searchsorted(t, y, side="right"), 1, len(t) - 1)
    lo, high, low = hi - 1, t[hi].astype(np.float64), t[hi - 1].astype(np.float64)
    frac = (y - low) / (high - low)
    if u is None:
        up, edge = frac > 0.5, np.abs(frac - 0.5) < 1e-4
    else:
        up, edge = u < frac, np.abs(u - frac) < 1e-4
    idx = lo + up
    if first == 0:
        idx = np.where((idx == 0) & (y > 0), 1, idx)
    return idx + first, edge


def bracket_width(x, name):
    """The distance between the two stored values around each element of `x`."""
    amax = np.abs(x).max(axis=1, keepdims=True).astype(np.float64)
    if name == "int8":
        return np.broadcast_to(amax / 127, x.shape)
    t, _ = table(name)
    y = x / np.where(amax > 0, amax, 1)
    hi = np.clip(np.searchsorted(t, y, side="right"), 1, len(t) - 1)
    return (t[hi].astype(np.float64) - t[hi - 1]) * amax


def value_of(codes, scale, name):
    if name == "int8":
        return codes.astype(np.float64) * (scale[:, None].astype(np.float64) / 127)
    t, first = table(name)
    return t[codes.astype(np.int64) - first].astype(np.float64) * scale[:, None]


@pytest.mark.parametrize("name", ["int8", "int8_log", "uint8_log"])
def test_nearest_codes_match_numpy_and_the_error_bound(name):
    x = rows(positive=name == "uint8_log")
    codes, scale = quantize(paddle.to_tensor(x), name)
    codes, scale = codes.numpy(), scale.numpy()
    assert codes.dtype == (np.uint8 if name == "uint8_log" else np.int8)
    np.testing.assert_array_equal(scale, np.abs(x).max(axis=1))  # the row's largest magnitude
    want, edge = oracle_codes(x, name)
    assert edge.mean() < 0.01
    np.testing.assert_array_equal(codes[~edge], want[~edge])
    assert (np.abs(codes.astype(np.int64) - want) <= 1).all()
    got = dequantize(paddle.to_tensor(codes), paddle.to_tensor(scale), name).numpy()
    np.testing.assert_allclose(got, value_of(codes, scale, name), rtol=2 ** -23, atol=0)
    err = np.abs(got.astype(np.float64) - x)
    amax = np.abs(x).max(axis=1, keepdims=True).astype(np.float64)
    if name == "int8":  # half a step, max|x| / 127, plus float32 rounding
        assert (err <= amax / 254 * (1 + 1e-5)).all()
    else:  # half the ratio of neighbours, relative; below the smallest code, the smallest code
        smallest = amax * (2.0 ** (-125 / 8) if name == "int8_log" else 2.0 ** (-254 / 8))
        big = np.abs(x) >= smallest
        assert (err[big] <= np.abs(x)[big] * (2 ** (1 / 8) - 1) / 2 * (1 + 1e-4)).all()
        assert (err[~big] <= np.broadcast_to(smallest, x.shape)[~big] * (1 + 1e-4)).all()
    assert (got[3] == 0).all() and np.isfinite(got).all()
    if name == "uint8_log":  # a positive value is never stored as 0
        assert (got[x > 0] > 0).all()


@pytest.mark.parametrize("name", ["int8", "int8_log", "uint8_log"])
def test_stochastic_codes_match_numpy_and_are_neighbours(name):
    x = rows(seed=1, positive=name == "uint8_log")
    u = uniform_noise(paddle.arange(x.shape[0], dtype="int64"), x.shape[1], seed=3, step=7)
    codes, scale = quantize(paddle.to_tensor(x), name, u)
    codes = codes.numpy().astype(np.int64)
    want, edge = oracle_codes(x, name, u.numpy().astype(np.float64))
    np.testing.assert_array_equal(codes[~edge], want[~edge])
    near, _ = oracle_codes(x, name)
    assert (np.abs(codes - near) <= 1).all()  # a neighbour of x, never further


def test_noise_is_uniform_and_a_function_of_the_row_not_the_chunk():
    ids = paddle.arange(1000, 3000, dtype="int64")
    u = uniform_noise(ids, 64, seed=1, step=2, rank=3, stream=4).numpy()
    assert u.dtype == np.float32 and u.min() >= 0 and u.max() < 1
    assert np.array_equal(u * 2 ** 23, np.floor(u * 2 ** 23))  # multiples of 2^-23
    assert abs(u.mean() - 0.5) < 4.5 * np.sqrt(1 / 12 / u.size)
    hist = np.bincount((u * 16).astype(int).ravel(), minlength=16) / u.size
    assert np.abs(hist - 1 / 16).max() < 0.005
    part = uniform_noise(ids[700:900], 64, seed=1, step=2, rank=3, stream=4).numpy()
    np.testing.assert_array_equal(part, u[700:900])
    for other in (dict(seed=2), dict(step=3), dict(rank=4), dict(stream=5)):
        kw = dict(dict(seed=1, step=2, rank=3, stream=4), **other)
        assert not np.array_equal(uniform_noise(ids, 64, **kw).numpy(), u), other


@pytest.mark.parametrize("name", ["int8", "int8_log", "uint8_log"])
def test_stochastic_writes_are_unbiased(name):
    """Over 400 draws (the optimizer's generator, a new step each) the mean stored value of
    each element is within 4.5 standard errors of x (a draw's spread is at most the step
    between x's two neighbours), and the z-scores average 0."""
    x = rows(n=16, d=32, seed=2, positive=name == "uint8_log")
    x[:, 0] *= 0.999  # the largest is exact; keep some rows' maxima off the top code
    ids = paddle.arange(16, dtype="int64")
    t = 400
    total = np.zeros(x.shape)
    for step in range(t):
        u = uniform_noise(ids, 32, seed=0, step=step)
        total += dequantize(*quantize(paddle.to_tensor(x), name, u), name).numpy()
    mean = total / t
    spread = np.maximum(bracket_width(x, name), np.abs(x) * 1e-6 + 1e-45)
    z = (mean - x) / (spread / 2 / np.sqrt(t))
    if name == "uint8_log":  # values below the smallest code are stored as it: not unbiased
        small = np.abs(x) < np.abs(x).max(axis=1, keepdims=True) * 2.0 ** (-254 / 8)
        z = z[~small]
    assert np.abs(z).max() < 4.5 * 1.6, np.abs(z).max()  # max of ~500 |N(0, ≤1)|
    assert abs(z.mean()) < 4.5 / np.sqrt(z.size)
    nearest = dequantize(*quantize(paddle.to_tensor(x), name), name).numpy()
    # rounding to nearest is biased; the mean of the stochastic draws is closer to x
    assert np.abs(mean - x).mean() < np.abs(nearest - x).mean()


def test_non_finite_rows_read_back_as_nan_and_leave_other_rows():
    x = rows(n=4, d=8)
    x[1, 2], x[2, 0] = np.inf, np.nan
    got = dequantize(*quantize(paddle.to_tensor(x))).numpy()
    assert np.isnan(got[1]).all() and np.isnan(got[2]).all()
    np.testing.assert_array_equal(got[[0, 3]], dequantize(*quantize(paddle.to_tensor(x[[0, 3]]))))


def _head_with_grads(opt_cls, state_dtype, ratio):
    paddle.seed(0)
    head = PartialFC(16, 50, CosFace(30.0, 0.35), sample_ratio=ratio, param_dtype="int8",
                     seed=1)
    opt = opt_cls(0.1, state_dtype=state_dtype, seed=2)
    return head, opt


@pytest.mark.parametrize("opt_cls", [SparseMomentum, SparseAdamW])
def test_updates_touch_only_the_sampled_rows_and_rescale_them(opt_cls):
    """Partial FC with int8 centres and state: after each step, rows not sampled keep codes and
    scale (weight and state) bit for bit; a sampled row's new scale is the largest magnitude
    of its new float32 values, which the update computed from the stored (dequantised) rows."""
    head, opt = _head_with_grads(opt_cls, None, 0.3)
    rng = np.random.RandomState(0)
    for step in range(3):
        before_w = (head.weight.codes.numpy().copy(), head.weight.scale.numpy().copy())
        state = opt.init_state(head)
        before_s = {k: (v.codes.numpy().copy(), v.scale.numpy().copy())
                    for k, v in state.items() if isinstance(v, Int8Rows)}
        old = rows_f32(head.weight).numpy()
        x = paddle.to_tensor(rng.normal(size=(8, 16)).astype(np.float32))
        head(x, paddle.to_tensor(rng.randint(0, 50, 8))).backward()
        index = head.sampled_rows.numpy()
        grad = head.sampled_weight.grad.numpy()
        opt.step(head)
        untouched = np.setdiff1d(np.arange(50), index)
        assert len(untouched) > 20
        np.testing.assert_array_equal(head.weight.codes.numpy()[untouched], before_w[0][untouched])
        np.testing.assert_array_equal(head.weight.scale.numpy()[untouched], before_w[1][untouched])
        for key, (codes, scale) in before_s.items():
            now = opt.state_dict()[key]
            np.testing.assert_array_equal(now.codes.numpy()[untouched], codes[untouched])
            np.testing.assert_array_equal(now.scale.numpy()[untouched], scale[untouched])
        new = rows_f32(head.weight).numpy()
        assert not np.array_equal(new[index], old[index])
        if opt_cls is SparseMomentum and step == 0:  # v = g (+ wd·w), w −= lr·v, from zero
            want = old[index] - 0.1 * grad.astype(np.float64)
            np.testing.assert_allclose(head.weight.scale.numpy()[index],
                                       np.abs(want).max(axis=1), rtol=1e-5)
            assert (np.abs(new[index] - want) <= np.abs(want).max(axis=1, keepdims=True) / 127
                    * (1 + 1e-5)).all()
    assert isinstance(opt.state_dict()[f"weight.{opt.state_names[0]}"], Int8Rows)
    if opt_cls is SparseAdamW:
        state = opt.state_dict()
        assert storage_name(state["weight.moment1"]) == "int8_log"
        assert storage_name(state["weight.moment2"]) == "uint8_log"
        assert state["weight.steps"].dtype == paddle.float32


def test_state_dtype_int8_with_float32_centres_and_float32_state_with_int8():
    head = PartialFC(16, 20, param_dtype="float32")
    opt = SparseMomentum(0.1, state_dtype="int8")
    assert isinstance(opt.init_state(head)["weight.velocity"], Int8Rows)
    head = PartialFC(16, 20, param_dtype="int8")
    opt = SparseMomentum(0.1, state_dtype="float32")
    assert opt.init_state(head)["weight.velocity"].dtype == paddle.float32


def test_int8_head_against_the_float64_oracle_on_unquantised_centres():
    """CosFace (the target logit is s·cos − s·m, 1-Lipschitz in cos over s): each centre row's
    stored values differ from the float32 ones by at most max|w|/254 an element, so each cosine
    by at most δ = 2·√d·max|w|/254 / |w| (|ŵ' − ŵ| ≤ 2|w' − w| / |w|), each logit by s·δ, and
    the mean loss by 2·s·max δ (softmax cross entropy moves by at most twice the largest logit
    change). The int8 head's loss is within that of the float64 oracle's on the float32
    centres, and measurably off it (the bound is not vacuous)."""
    rng = np.random.RandomState(0)
    d, c, n = 32, 60, 24
    w = rng.normal(size=(c, d)).astype(np.float32)
    y = rng.randint(0, c, n)
    x = (w[y] * 2 + rng.normal(size=(n, d))).astype(np.float32)
    margin = CosFace(30.0, 0.35)
    head = PartialFC(d, c, margin, param_dtype="int8")
    head.weight.set_value(w)
    loss = float(head(paddle.to_tensor(x), paddle.to_tensor(y)))
    step = np.abs(w).max(axis=1).astype(np.float64) / 254
    delta = 2 * np.sqrt(d) * step / np.linalg.norm(w.astype(np.float64), axis=1)
    bound = 2 * 30.0 * delta.max()
    ref = dense_reference(x, y, w, margin)["loss"]
    assert abs(loss - ref) <= bound, (loss, ref, bound)
    assert abs(loss - ref) > 1e-6  # quantisation shows
    stored = rows_f32(head.weight).numpy()
    assert abs(loss - dense_reference(x, y, stored, margin)["loss"]) < 1e-5 * abs(ref)


def test_an_int8_weight_needs_a_row_update():
    w = Int8Rows.from_float(paddle.randn([10, 8]))
    with pytest.raises(ValueError, match="8-bit weight .* row_update"):
        parallel_softmax_cross_entropy(paddle.randn([4, 8]), w, None,
                                       paddle.to_tensor([0, 1, -1, 2], dtype="int64"),
                                       CosFace())


# ---------------------------------------------------------------- checkpoints

def records(x, name):
    """How a checkpoint stores float32 rows `x` as 8-bit map `name` (nearest): numpy records
    of (scale, codes), from this file's oracle."""
    codes, edge = oracle_codes(x, name)
    assert not edge.any()
    out = np.empty(x.shape[0], [("scale", "<f4"),
                                ("codes", "u1" if name == "uint8_log" else "i1", (x.shape[1],))])
    out["scale"], out["codes"] = np.abs(x).max(axis=1), codes
    return out


def test_save_writes_records_a_plain_numpy_reads_and_the_manifest_covers_them(tmp_path,
                                                                                monkeypatch):
    import plsc.checkpoint as ckpt
    import plsc.checkpoint.head_arrays as store
    monkeypatch.setattr(store, "_SLAB_BYTES", 100)  # many slabs, the last one partial
    x, m2 = rows(n=37, d=12, seed=4), rows(n=37, d=12, seed=5, positive=True)
    arrays = {"weight": Int8Rows.from_float(paddle.to_tensor(x)),
              "opt.weight.moment2": Int8Rows.from_float(paddle.to_tensor(m2), "uint8_log"),
              "opt.weight.steps": paddle.arange(37, dtype="float32")}
    path = ckpt.CheckpointManager(str(tmp_path)).save(
        3, {"num_classes": 37, "head_arrays": sorted(arrays)}, {"w": paddle.zeros([1])},
        {"lr": paddle.zeros([1])}, arrays)
    meta = ckpt.read_meta(path)
    assert meta["head_dtypes"] == {"weight": "int8", "opt.weight.moment2": "uint8_log",
                                   "opt.weight.steps": "float32"}
    for name, values, kind in (("weight", x, "int8"), ("opt.weight.moment2", m2, "uint8_log")):
        stored = np.load(f"{path}/head_rank0/{name}.npy")
        want = records(values, kind)
        assert stored.dtype == want.dtype and stored.shape == (37,)
        np.testing.assert_array_equal(stored["codes"], want["codes"])
        np.testing.assert_array_equal(stored["scale"], want["scale"])
    ckpt.verify_checkpoint(path)
    with open(f"{path}/head_rank0/weight.npy", "r+b") as f:  # one code byte flipped
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ckpt.CheckpointDamaged, match="weight.npy"):
        ckpt.verify_checkpoint(path)


def test_reshard_2_to_3_and_loads_across_dtypes(tmp_path, monkeypatch):
    """An int8 checkpoint of 2 ranks re-sharded for 3 keeps every record bit for bit; the rows
    load into an 8-bit array as stored, into float32 as their values, into bfloat16 rounded
    from those; a float32 and a bfloat16 checkpoint load into an 8-bit array quantised to
    nearest (this file's oracle)."""
    import plsc.checkpoint as ckpt
    import plsc.checkpoint.head_arrays as store
    from plsc.distributed import ClassPartition
    from dtypes.test_checkpoint import C, D, bf16_bits_nearest_even, bf16_to_float32, \
        write_checkpoint
    monkeypatch.setattr(store, "_SLAB_BYTES", 2 * (4 + D))  # slabs of 2 records
    x, v = rows(n=C, d=D, seed=6), rows(n=C, d=D, seed=7)
    w8, v8 = records(x, "int8"), records(v, "int8")
    src = write_checkpoint(tmp_path / "ck", {"weight": ("int8", w8),
                                             "opt.weight.velocity": ("int8", v8)}, 2)
    dst = ckpt.reshard_checkpoint(src, str(tmp_path / "three"), 3)
    assert ckpt.read_meta(dst)["head_dtypes"] == {"weight": "int8", "opt.weight.velocity": "int8"}
    parts = [np.load(f"{dst}/head_rank{r}/weight.npy") for r in range(3)]
    assert [len(p) for p in parts] == [4, 4, 3]
    assert np.concatenate(parts).tobytes() == w8.tobytes()
    part = ClassPartition(C, 3)
    values = w8["codes"].astype(np.float32) * (w8["scale"][:, None] / np.float32(127))
    for r in range(3):
        lo, n = part.class_start(r), part.num_local(r)
        mine = Int8Rows.zeros([n, D])
        ckpt.load_head_rows_into(dst, "weight", lo, mine)
        np.testing.assert_array_equal(mine.codes.numpy(), w8["codes"][lo:lo + n])
        np.testing.assert_array_equal(mine.scale.numpy(), w8["scale"][lo:lo + n])
        f32 = paddle.zeros([n, D])
        ckpt.load_head_rows_into(dst, "weight", lo, f32)
        np.testing.assert_array_equal(f32.numpy(), values[lo:lo + n])
        bf = paddle.zeros([n, D], dtype="bfloat16")
        ckpt.load_head_rows_into(dst, "weight", lo, bf)
        np.testing.assert_array_equal(bf.numpy(), bf16_bits_nearest_even(values[lo:lo + n]))
    for kind, stored, as_f32 in (("float32", x, x),
                                 ("bfloat16", bf16_bits_nearest_even(x),
                                  bf16_to_float32(bf16_bits_nearest_even(x)))):
        path = write_checkpoint(tmp_path / kind, {"weight": (kind, stored)}, 2)
        mine = Int8Rows.zeros([C, D])
        ckpt.load_head_rows_into(path, "weight", 0, mine)
        want = records(as_f32, "int8")
        np.testing.assert_array_equal(mine.codes.numpy(), want["codes"])
        np.testing.assert_array_equal(mine.scale.numpy(), want["scale"])


def test_export_gives_float32_values_and_import_quantises(tmp_path):
    import plsc.checkpoint as ckpt
    from dtypes.test_checkpoint import C, D, write_checkpoint
    x = rows(n=C, d=D, seed=8)
    w8 = records(x, "int8")
    src = write_checkpoint(tmp_path / "ck", {"weight": ("int8", w8),
                                             "opt.weight.velocity": ("int8", w8)}, 3)
    ckpt.export_classifier(src, str(tmp_path / "w.npy"))
    out = np.load(str(tmp_path / "w.npy"))
    assert out.dtype == np.float32 and out.shape == (C, D)
    np.testing.assert_array_equal(out, w8["codes"] * (w8["scale"][:, None] / np.float32(127)))
    new = rows(n=C, d=D, seed=9)
    np.save(str(tmp_path / "new.npy"), new)
    dst = ckpt.import_classifier(src, str(tmp_path / "imported"), str(tmp_path / "new.npy"))
    assert ckpt.read_meta(dst)["head_dtypes"]["weight"] == "int8"
    got = ckpt.load_head_rows(dst, "weight", 0, C)
    assert got.tobytes() == records(new, "int8").tobytes()
    state = ckpt.load_head_rows(dst, "opt.weight.velocity", 0, C)
    assert not state["codes"].any() and not state["scale"].any()


@pytest.mark.parametrize("name", ["int8", "int8_log", "uint8_log"])
def test_cpu_numpy_path_gives_the_paddle_ops_bits(name, monkeypatch):
    """On the CPU `quantize`/`dequantize` run in numpy; the Paddle ops every other device runs
    give the same codes, scales and values bit for bit (nearest and stochastic)."""
    import plsc.storage.int8 as q
    x = paddle.to_tensor(rows(seed=11, positive=name == "uint8_log"))
    x[2, 4] = float("inf")
    u = uniform_noise(paddle.arange(x.shape[0], dtype="int64"), x.shape[1], seed=5)
    cpu = [quantize(x, name), quantize(x, name, u)]
    cpu_values = [dequantize(c, s, name) for c, s in cpu]
    monkeypatch.setattr(q, "_on_cpu", lambda *t: False)
    ops = [quantize(x, name), quantize(x, name, u)]
    for (c1, s1), (c2, s2), v1 in zip(cpu, ops, cpu_values):
        assert c1.dtype == c2.dtype
        np.testing.assert_array_equal(c1.numpy(), c2.numpy())
        np.testing.assert_array_equal(s1.numpy(), s2.numpy())  # NaN where the row had inf
        np.testing.assert_array_equal(v1.numpy(), dequantize(c2, s2, name).numpy())


def test_reshard_tool_converts_an_int8_checkpoint_to_float32(tmp_path, capsys):
    """`tools/reshard.py CKPT --dtype float32`: every 8-bit array becomes its float32 values
    (this file's oracle), float32 counters stay, the stored config names the new dtype, and
    the result verifies against its manifest."""
    import json
    import plsc.checkpoint as ckpt
    import scripts
    reshard = scripts.load("tools/reshard.py")
    from dtypes.test_checkpoint import C, D, write_checkpoint
    x, m2 = rows(n=C, d=D, seed=12), rows(n=C, d=D, seed=13, positive=True)
    steps = np.arange(C, dtype=np.float32)
    src = write_checkpoint(tmp_path / "ck", {"weight": ("int8", records(x, "int8")),
                                             "opt.weight.moment2": ("uint8_log",
                                                                    records(m2, "uint8_log")),
                                             "opt.weight.steps": ("float32", steps)}, 2)
    meta = json.load(open(f"{src}/meta.json"))
    meta["config"] = {"Loss": {"param_dtype": "int8"}, "Optimizer": {"head_state_dtype": "int8"}}
    json.dump(meta, open(f"{src}/meta.json", "w"))
    dst = str(tmp_path / "f32")
    assert reshard.main([src, "--dtype", "float32", "--output", dst, "--verify", "none"]) == 0
    assert "head arrays stored as float32" in capsys.readouterr().out
    ckpt.verify_checkpoint(dst)
    meta = ckpt.read_meta(dst)
    assert meta["head_dtypes"] == {"weight": "float32", "opt.weight.moment2": "float32",
                                   "opt.weight.steps": "float32"}
    assert meta["config"]["Loss"]["param_dtype"] == "float32"
    assert meta["config"]["Optimizer"]["head_state_dtype"] is None
    for name, values, kind in (("weight", x, "int8"), ("opt.weight.moment2", m2, "uint8_log")):
        rec = records(values, kind)
        want = value_of(rec["codes"], rec["scale"], kind).astype(np.float32)
        got = ckpt.load_head_rows(dst, name, 0, C)
        np.testing.assert_allclose(got, want, rtol=2 ** -23, atol=0)
    np.testing.assert_array_equal(ckpt.load_head_rows(dst, "opt.weight.steps", 0, C), steps)
    with pytest.raises(SystemExit):  # argparse's choices: floats only
        reshard.main([src, "--dtype", "int8", "--output", str(tmp_path / "x")])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


@pytest.mark.parametrize("d", [6, 7, 8])
def test_indexed_writes_of_any_row_width_touch_only_their_rows(d):
    """Rows written through an index (Partial FC's sampled rows) at widths the int32 scatter
    cannot take (6, 7) and can (8): those rows hold the quantised values, the others stay."""
    x = rows(n=10, d=d, seed=14)
    stored = Int8Rows.from_float(paddle.to_tensor(x))
    before = stored.codes.numpy().copy(), stored.scale.numpy().copy()
    index = np.array([7, 1, 4])
    new = rows(n=3, d=d, seed=15)
    stored.write(paddle.to_tensor(index), paddle.to_tensor(new))
    codes, scale = quantize(paddle.to_tensor(new))
    np.testing.assert_array_equal(stored.codes.numpy()[index], codes.numpy())
    np.testing.assert_array_equal(stored.scale.numpy()[index], scale.numpy())
    rest = np.setdiff1d(np.arange(10), index)
    np.testing.assert_array_equal(stored.codes.numpy()[rest], before[0][rest])
    np.testing.assert_array_equal(stored.scale.numpy()[rest], before[1][rest])
    np.testing.assert_array_equal(stored.take(paddle.to_tensor(index)).numpy(),
                                  dequantize(codes, scale).numpy())


@pytest.mark.parametrize("name", ["int8_log", "uint8_log"])
def test_the_cpu_bracket_search_is_numpys_searchsorted(name):
    """The CPU path finds each value's place in a logarithmic map from log2 (no binary search);
    on the map's own values, their float32 neighbours, zeros, ±1 and values far below the
    smallest step it is `np.searchsorted(table, y, side="right")`."""
    from plsc.storage.int8 import INT8_MAPS, _count_at_most
    t = INT8_MAPS[name].table
    rng = np.random.RandomState(3)
    y = rng.uniform(-1, 1, 200000) * np.exp(rng.uniform(-30, 0, 200000))
    y = np.concatenate([y, t, np.nextafter(t, np.float32(2)), np.nextafter(t, np.float32(-2)),
                        [0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1e-45]]).astype(np.float32)
    y = np.clip(y, -1, 1)
    if name == "uint8_log":
        y = np.abs(y)
    np.testing.assert_array_equal(_count_at_most(INT8_MAPS[name], y),
                                  np.searchsorted(t, y, side="right"))
