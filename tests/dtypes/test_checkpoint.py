"""16-bit head arrays in checkpoints: bfloat16 stored as its bits, loading into any dtype on
any world size, re-sharding, export and import. The oracles are numpy bit manipulation."""
import json
import os
import re

import numpy as np
import paddle
import pytest

import plsc.checkpoint as ckpt
import plsc.checkpoint.head_arrays as store
from plsc.distributed import ClassPartition

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets

C, D = 11, 6  # classes, embedding size


def bf16_bits_nearest_even(x):
    """float32 -> bfloat16 bits, rounded to nearest even (no NaN in these tests)."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_float32(bits):
    """bfloat16 bits -> float32: the bits become the high half of each little-endian word."""
    words = np.zeros(bits.shape + (2,), np.uint16)
    words[..., 1] = bits
    return words.view(np.float32)[..., 0]


def values(shape, seed=0):
    """float32 values with many bfloat16/float16 ties and tiny magnitudes (Paddle 3.3's
    float16 cast bug lies at 2^-89..2^-77)."""
    rng = np.random.RandomState(seed)
    x = rng.normal(size=shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[::5] = bf16_to_float32(rng.randint(0x3300, 0x4780, flat[::5].shape).astype(np.uint16)) \
        * np.float32(1 + 2.0 ** -8)  # 2^-25..2^16: ties in bf16, finite in fp16
    flat[1::7] = (np.float32(1.0) + np.float32(2.0 ** -8)) * (1 + np.arange(len(flat[1::7])) % 3)
    flat[2::11] = np.float32(2.0 ** -83)
    return x


def stored(dtype, x):
    """How a checkpoint holds float32 `x` as head dtype `dtype` (numpy)."""
    if dtype == "bfloat16":
        return bf16_bits_nearest_even(x)
    return x.astype(dtype)


def as_float32(dtype, rows):
    return bf16_to_float32(rows) if dtype == "bfloat16" else rows.astype(np.float32)


def tensor_of(dtype, rows):
    """A Paddle tensor of `dtype` holding the stored numpy `rows` bit for bit."""
    t = paddle.to_tensor(rows)
    assert str(t.dtype) == f"paddle.{dtype}"
    return t


def write_checkpoint(path, arrays, world_size, dtypes=True):
    """A checkpoint folder of `world_size` shards holding `arrays` {name: (dtype, rows as
    stored)}; `dtypes=False` leaves out `head_dtypes` (an older checkpoint)."""
    part = ClassPartition(C, world_size)
    for r in range(world_size):
        os.makedirs(os.path.join(path, f"head_rank{r}"))
        lo, n = part.class_start(r), part.num_local(r)
        for name, (dtype, rows) in arrays.items():
            np.save(os.path.join(path, f"head_rank{r}", f"{name}.npy"), rows[lo:lo + n])
    for name in ("backbone.pdparams", "trainer.pdstates"):  # only copied here
        open(os.path.join(path, name), "wb").close()
    meta = {"num_classes": C, "world_size": world_size, "shard_size": part.shard_size,
            "head_arrays": sorted(arrays), "head_opt_step_count": 5}
    if dtypes:
        meta["head_dtypes"] = {name: dtype for name, (dtype, _) in arrays.items()}
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    return str(path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_save_writes_what_numpy_would(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(store, "_SLAB_BYTES", 50)  # many slabs, the last one partial
    rows = stored(dtype, values((37, D)))
    name = ckpt.save_rows_npy(str(tmp_path / "w.npy"), tensor_of(dtype, rows))
    assert name == dtype
    np.save(str(tmp_path / "numpy.npy"), rows)  # bfloat16: the uint16 bits
    assert (tmp_path / "w.npy").read_bytes() == (tmp_path / "numpy.npy").read_bytes()


def test_manager_records_head_dtypes(tmp_path):
    arrays = {"weight": tensor_of("bfloat16", stored("bfloat16", values((C, D)))),
              "opt.weight.velocity": tensor_of("float16", stored("float16", values((C, D)))),
              "opt.weight.steps": paddle.zeros([C], dtype="float32")}
    path = ckpt.CheckpointManager(str(tmp_path)).save(
        3, {"num_classes": C, "head_arrays": sorted(arrays)}, {"w": paddle.zeros([1])},
        {"lr": paddle.zeros([1])}, arrays)
    meta = ckpt.read_meta(path)
    assert meta["head_dtypes"] == {"weight": "bfloat16", "opt.weight.velocity": "float16",
                                   "opt.weight.steps": "float32"}
    assert np.load(os.path.join(path, "head_rank0", "weight.npy")).dtype == np.uint16


_CONVERSIONS = [  # (stored dtype, tensor dtype)
    ("float32", "bfloat16"), ("bfloat16", "float32"), ("float32", "float16"),
    ("float16", "float32"), ("bfloat16", "bfloat16"), ("float16", "bfloat16"),
    ("bfloat16", "float16"), ("float32", "float32")]


def expected_load(src, dst, rows):
    """Numpy oracle: `rows` stored as `src`, read into a `dst` tensor (as `dst` is stored)."""
    x = as_float32(src, rows)  # exact
    return stored(dst, x)  # to nearest even


@pytest.mark.parametrize("src,dst", _CONVERSIONS)
def test_load_converts_across_dtypes_and_world_sizes(tmp_path, monkeypatch, src, dst):
    """Written as 2 shards, read as the rows of 3 shards (slabs of 2 rows) into each dtype."""
    monkeypatch.setattr(store, "_SLAB_BYTES", 2 * 4 * D)
    weight, bias = stored(src, values((C, D))), stored(src, values((C,), seed=1))
    path = write_checkpoint(tmp_path / "ck", {"weight": (src, weight), "bias": (src, bias)}, 2)
    part = ClassPartition(C, 3)
    for name, rows in (("weight", weight), ("bias", bias)):
        got = []
        for r in range(3):
            lo, n = part.class_start(r), part.num_local(r)
            t = paddle.zeros([n] + list(rows.shape[1:]), dtype=dst)
            ckpt.load_head_rows_into(path, name, lo, t)
            got.append(t.numpy())
        np.testing.assert_array_equal(np.concatenate(got), expected_load(src, dst, rows))


def test_load_fills_a_parameter_in_place(tmp_path):
    bits = stored("bfloat16", values((C, D)))
    path = write_checkpoint(tmp_path / "ck", {"weight": ("bfloat16", bits)}, 2)
    w = paddle.create_parameter([4, D], "float32",
                                default_initializer=paddle.nn.initializer.Constant(0.0))
    address = w.data_ptr()
    ckpt.load_head_rows_into(path, "weight", 5, w)
    assert w.data_ptr() == address and not w.stop_gradient
    np.testing.assert_array_equal(w.numpy(), bf16_to_float32(bits[5:9]))


def test_older_checkpoint_means_the_npy_dtype(tmp_path):
    weight = values((C, D))
    path = write_checkpoint(tmp_path / "ck", {"weight": ("float32", weight)}, 2, dtypes=False)
    assert ckpt.head_dtype(path, "weight") == "float32"
    t = paddle.zeros([C, D], dtype="bfloat16")
    ckpt.load_head_rows_into(path, "weight", 0, t)
    np.testing.assert_array_equal(t.numpy(), bf16_bits_nearest_even(weight))


def test_mismatched_file_names_file_dtype_and_shape(tmp_path):
    bits = stored("bfloat16", values((C, D)))
    path = write_checkpoint(tmp_path / "ck", {"weight": ("bfloat16", bits)}, 2)
    t = paddle.zeros([C, D + 1], dtype="bfloat16")
    file = os.path.join(path, "head_rank0", "weight.npy")
    with pytest.raises(ValueError, match=re.escape(file) + r" holds uint16 of shape \(6, 6\); "
                       r"expected bfloat16 \(stored as uint16\) of shape \(6, 7\)"):
        ckpt.load_head_rows_into(path, "weight", 0, t)
    np.save(file, values((6, D)))  # float32 where meta.json says bfloat16
    with pytest.raises(ValueError, match=re.escape(file) + r" holds float32 .*expected bfloat16"):
        ckpt.load_head_rows(path, "weight", 0, C)
    with pytest.raises(KeyError, match=r"no head array 'bias'"):
        ckpt.load_head_rows_into(path, "bias", 0, paddle.zeros([C]))


def test_reshard_copies_bits_and_keeps_dtypes(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "_SLAB_BYTES", 3 * 2 * D)  # slabs of 3 rows
    weight = stored("bfloat16", values((C, D)))
    velocity = stored("float16", values((C, D), seed=2))
    src = write_checkpoint(tmp_path / "ck", {"weight": ("bfloat16", weight),
                                             "opt.weight.velocity": ("float16", velocity)}, 2)
    dst = ckpt.reshard_checkpoint(src, str(tmp_path / "three"), 3)
    meta = ckpt.read_meta(dst)
    assert meta["world_size"] == 3 and meta["head_opt_step_count"] == 5
    assert meta["head_dtypes"] == {"weight": "bfloat16", "opt.weight.velocity": "float16"}
    for name, rows in (("weight", weight), ("opt.weight.velocity", velocity)):
        parts = [np.load(os.path.join(dst, f"head_rank{r}", f"{name}.npy")) for r in range(3)]
        assert [len(p) for p in parts] == [4, 4, 3]
        assert all(p.dtype == rows.dtype for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), rows)


def test_reshard_of_an_older_checkpoint_records_dtypes(tmp_path):
    weight = stored("float16", values((C, D)))
    src = write_checkpoint(tmp_path / "ck", {"weight": ("float16", weight)}, 2, dtypes=False)
    dst = ckpt.reshard_checkpoint(src, str(tmp_path / "one"), 1)
    assert ckpt.read_meta(dst)["head_dtypes"] == {"weight": "float16"}


def test_export_upcasts_bfloat16_and_keeps_16_bit_floats(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "_SLAB_BYTES", 4 * 4 * D)
    weight = stored("bfloat16", values((C, D)))
    velocity = stored("float16", values((C, D), seed=2))
    src = write_checkpoint(tmp_path / "ck", {"weight": ("bfloat16", weight),
                                             "opt.weight.velocity": ("float16", velocity)}, 3)
    ckpt.export_classifier(src, str(tmp_path / "w.npy"))
    out = np.load(str(tmp_path / "w.npy"))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, bf16_to_float32(weight))
    ckpt.export_classifier(src, str(tmp_path / "v.npy"), "opt.weight.velocity")
    out = np.load(str(tmp_path / "v.npy"))
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, velocity)


def test_import_rounds_into_the_checkpoint_dtype(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "_SLAB_BYTES", 4 * 4 * D)
    weight = stored("bfloat16", values((C, D)))
    velocity = stored("bfloat16", values((C, D), seed=2))
    bias = values((C,), seed=3)
    src = write_checkpoint(tmp_path / "ck", {"weight": ("bfloat16", weight),
                                             "bias": ("float32", bias),
                                             "opt.weight.velocity": ("bfloat16", velocity)}, 2)
    new = values((C, D), seed=4).astype(np.float64)
    # float64 values whose float32 rounding lands on a bfloat16 tie: rounded once, they go up
    tie_up = 1 + 2.0 ** -8 + 2.0 ** -40
    new[0, :3] = [tie_up, -tie_up, 3 + 2.0 ** -7 - 2.0 ** -45]
    expect = bf16_bits_nearest_even(new.astype(np.float32))
    expect[0, :3] = [0x3F81, 0xBF81, 0x4040]
    np.save(str(tmp_path / "new.npy"), new)
    new_bias = values((C,), seed=5).astype(np.float16)
    np.save(str(tmp_path / "bias.npy"), new_bias)
    dst = ckpt.import_classifier(src, str(tmp_path / "imported"), str(tmp_path / "new.npy"),
                                 str(tmp_path / "bias.npy"))
    assert ckpt.read_meta(dst)["head_dtypes"]["weight"] == "bfloat16"
    np.testing.assert_array_equal(ckpt.load_head_rows(dst, "weight", 0, C), expect)
    np.testing.assert_array_equal(ckpt.load_head_rows(dst, "bias", 0, C),
                                  new_bias.astype(np.float32))
    assert not ckpt.load_head_rows(dst, "opt.weight.velocity", 0, C).any()


def test_import_rejects_a_non_float_or_misshapen_array(tmp_path):
    weight = stored("bfloat16", values((C, D)))
    src = write_checkpoint(tmp_path / "ck", {"weight": ("bfloat16", weight)}, 1)
    bad = str(tmp_path / "bad.npy")
    np.save(bad, np.zeros((C, D), np.uint16))
    with pytest.raises(ValueError, match=re.escape(bad) + r" holds uint16 of shape \(11, 6\); "
                                         r"expected a float"):
        ckpt.import_classifier(src, str(tmp_path / "x"), bad)
    np.save(bad, np.zeros((C, D + 1), np.float32))
    with pytest.raises(ValueError, match=r"expected a float array .* of shape \(11, 6\)"):
        ckpt.import_classifier(src, str(tmp_path / "x"), bad)


def _fake_trainer(weight_dtype, state_dtype, class_start, rows):
    """What `Trainer._resume_head` and `_head_arrays` use: a head (weight, no bias) of `rows`
    classes from `class_start`, a sparse Momentum keeping its state in `state_dtype`, and a
    log keeping its lines (`fake.lines`)."""
    from types import SimpleNamespace

    from plsc.train.trainer import Trainer
    from plsc.optim import SparseMomentum
    weight = paddle.create_parameter([rows, D], weight_dtype,
                                     default_initializer=paddle.nn.initializer.Constant(0.0))
    head = SimpleNamespace(weight=weight, bias=None, sampled_index=None, sampled_rows=None,
                           class_start=class_start, num_local=rows, sub_centers=1)
    fake = SimpleNamespace(head=head, head_opt=SparseMomentum(0.1, state_dtype=state_dtype),
                           lines=[])
    fake.log = SimpleNamespace(info=fake.lines.append)
    fake._head_arrays = Trainer._head_arrays.__get__(fake)
    return fake, lambda path: Trainer._resume_head(fake, path, ckpt.read_meta(path))


def test_trainer_resumes_a_float32_checkpoint_into_16_bit_storage(tmp_path):
    weight, velocity = values((C, D)), values((C, D), seed=2)
    path = write_checkpoint(tmp_path / "ck", {"weight": ("float32", weight),
                                              "opt.weight.velocity": ("float32", velocity)}, 2)
    fake, resume = _fake_trainer("bfloat16", "float16", 4, 4)  # rank 1 of 3
    resume(path)
    np.testing.assert_array_equal(fake.head.weight.numpy(), bf16_bits_nearest_even(weight[4:8]))
    state = fake.head_opt.state_dict()
    np.testing.assert_array_equal(state["weight.velocity"].numpy(),
                                  velocity[4:8].astype(np.float16))
    assert fake.head_opt.step_count == 5 and int(state["step_count"]) == 5  # head_opt_step_count
    assert sorted(fake._head_arrays()) == ["opt.weight.velocity", "weight"]  # no step_count
    assert fake.lines == ["head optimizer state: checkpoint has float32 (velocity), this run "
                          "stores float16: converted on load"]  # the centres' dtype aside


def test_trainer_resume_names_arrays_the_run_does_not_keep(tmp_path):
    from plsc.config import ConfigError
    path = write_checkpoint(tmp_path / "ck", {"weight": ("float32", values((C, D))),
                                              "opt.weight.moment1": ("float32", values((C, D)))}, 1)
    _, resume = _fake_trainer("float32", None, 0, C)
    with pytest.raises(ConfigError, match=r"head arrays \['opt.weight.moment1', 'weight'\]; "
                                          r"this run's head and SparseMomentum keep "
                                          r"\['opt.weight.velocity', 'weight'\]"):
        resume(path)
