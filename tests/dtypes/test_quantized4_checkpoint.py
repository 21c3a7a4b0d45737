"""4-bit head state in checkpoints (`plsc.storage.int4` through `plsc.checkpoint`): records of
scales and bytes, checksums, resume bit for bit, loads across dtypes, re-sharding; on both
kernel sets. The oracle and the runs are test_quantized4.py's."""
import numpy as np
import paddle
import pytest

from plsc.nn import PartialFC
from plsc.optim import SparseAdamW, SparseMomentum
from plsc.storage.int4 import Int4Rows
from plsc.storage import name as storage_name, read as rows_f32

from dtypes.test_quantized4 import (B, _assert_same, _bits, _partial_fc_run, oracle_index,
                                    oracle_scales, oracle_unpack, rows, values_of)

pytestmark = pytest.mark.usefixtures("kernels")  # every test on both kernel sets


@pytest.mark.parametrize("opt_cls", [SparseMomentum, SparseAdamW])
def test_checkpoint_round_trip_and_resume_are_bit_identical(opt_cls, tmp_path, monkeypatch):
    """Two steps, a checkpoint (records of scales and bytes, streamed in slabs, checksummed),
    a load into fresh arrays, two more steps: the bits of the uninterrupted four steps. The
    records hold the arrays' scales and bytes as they are; a flipped byte is caught."""
    import plsc.checkpoint as ckpt
    import plsc.checkpoint.head_arrays as store
    monkeypatch.setattr(store, "_SLAB_BYTES", 7 * (B + 8))  # slabs of a few records
    whole = _bits(*_partial_fc_run(opt_cls, True, (0, 4)))
    head, opt = _partial_fc_run(opt_cls, True, (0, 2))
    arrays = {f"opt.{k}": v for k, v in opt.state_dict().items() if k != "step_count"}
    path = ckpt.CheckpointManager(str(tmp_path)).save(
        2, {"num_classes": 60, "head_arrays": sorted(arrays)}, {"w": paddle.zeros([1])},
        {"lr": paddle.zeros([1])}, arrays)
    meta = ckpt.read_meta(path)
    for key, a in arrays.items():
        if not isinstance(a, Int4Rows):
            continue
        assert meta["head_dtypes"][key] == storage_name(a)
        rec = np.load(f"{path}/head_rank0/{key}.npy")
        assert rec.dtype.names == ("scale", "codes") and rec.shape == (60,)
        np.testing.assert_array_equal(rec["codes"], a.codes.numpy())
        np.testing.assert_array_equal(rec["scale"], a.scale.numpy())
    ckpt.verify_checkpoint(path)
    loaded = {}
    for key, a in arrays.items():
        fresh = Int4Rows.zeros(a.shape, storage_name(a)) if isinstance(a, Int4Rows) else \
            paddle.zeros(a.shape, "float32")
        loaded[key[len("opt."):]] = ckpt.load_head_rows_into(path, key, 0, fresh)
    loaded["step_count"] = opt.state_dict()["step_count"].numpy()
    w = (head.weight.codes.numpy(), head.weight.scale.numpy(), head.sample_step.numpy())
    resumed = _bits(*_partial_fc_run(opt_cls, True, (2, 4), state=(w, loaded)))
    _assert_same(whole, resumed)
    other = _bits(*_partial_fc_run(opt_cls, True, (0, 4), seed=3))  # another seed: other bits
    assert not np.array_equal(other["w.codes"], whole["w.codes"])
    key = next(k for k, a in arrays.items() if isinstance(a, Int4Rows))
    with open(f"{path}/head_rank0/{key}.npy", "r+b") as f:  # one code byte flipped
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ckpt.CheckpointDamaged, match=key):
        ckpt.verify_checkpoint(path)


def test_options_and_loads_across_dtypes(tmp_path):
    """state_dtype "int4" gives 4-bit state with float32 centres too; a 4-bit checkpoint array
    loads into float32 as its values."""
    import plsc.checkpoint as ckpt
    opt = SparseMomentum(0.1, state_dtype="int4")
    state = opt.init_state(PartialFC(2 * B, 20, param_dtype="float32"))
    assert isinstance(state["weight.velocity"], Int4Rows)
    with pytest.raises(ValueError, match="int4"):
        SparseMomentum(0.1, state_dtype="int2")
    x = rows(n=20, d=2 * B)
    a = Int4Rows.from_float(paddle.to_tensor(x))
    path = ckpt.CheckpointManager(str(tmp_path)).save(
        1, {"num_classes": 20, "head_arrays": ["opt.weight.velocity"]}, {"w": paddle.zeros([1])},
        {"lr": paddle.zeros([1])}, {"opt.weight.velocity": a})
    f32 = ckpt.load_head_rows_into(path, "opt.weight.velocity", 0, paddle.zeros([20, 2 * B]))
    np.testing.assert_array_equal(f32.numpy(), values_of(a.codes.numpy(), a.scale.numpy(),
                                                         a.map.name, 2 * B).astype(np.float32))


def oracle_records(x, name):
    """How a checkpoint stores float32 rows `x` as 4-bit map `name` (nearest), from this
    file's oracle: records of (block scales, bytes with element 2j in the low nibble)."""
    index, edge = oracle_index(x, name)
    assert not edge.any()
    nib = (index - (0 if name == "uint4_log" else 7)) % 16
    out = np.empty(x.shape[0], [("scale", "<f4", (-(-x.shape[1] // B),)),
                                ("codes", "u1", (x.shape[1] // 2,))])
    out["scale"], out["codes"] = oracle_scales(x), nib[:, 0::2] | (nib[:, 1::2] << 4)
    return out


def test_reshard_2_to_3_and_loads_from_other_dtypes(tmp_path, monkeypatch):
    """A 4-bit checkpoint of 2 ranks re-sharded for 3 keeps every record bit for bit and loads
    into 4-bit rows as stored; float32 and int8 checkpoints load into 4-bit rows quantised to
    nearest from their values (this file's oracle)."""
    import plsc.checkpoint as ckpt
    import plsc.checkpoint.head_arrays as store
    from plsc.distributed import ClassPartition
    from plsc.storage.int8 import Int8Rows
    from dtypes.test_checkpoint import C, write_checkpoint
    d = 2 * B + 4
    monkeypatch.setattr(store, "_SLAB_BYTES", 2 * (12 + d // 2))  # slabs of 2 records
    x = rows(n=C, d=d, seed=8)
    rec = oracle_records(x, "int4_log")
    src = write_checkpoint(tmp_path / "ck", {"opt.weight.velocity": ("int4_log", rec)}, 2)
    dst = ckpt.reshard_checkpoint(src, str(tmp_path / "three"), 3)
    assert ckpt.read_meta(dst)["head_dtypes"] == {"opt.weight.velocity": "int4_log"}
    parts = [np.load(f"{dst}/head_rank{r}/opt.weight.velocity.npy") for r in range(3)]
    assert np.concatenate(parts).tobytes() == rec.tobytes()
    part = ClassPartition(C, 3)
    for r in range(3):
        lo, n = part.class_start(r), part.num_local(r)
        mine = ckpt.load_head_rows_into(dst, "opt.weight.velocity", lo,
                                       Int4Rows.zeros([n, d], "int4_log"))
        np.testing.assert_array_equal(mine.codes.numpy(), rec["codes"][lo:lo + n])
        np.testing.assert_array_equal(mine.scale.numpy(), rec["scale"][lo:lo + n])
    v8 = Int8Rows.from_float(paddle.to_tensor(x))
    as_f32 = rows_f32(v8).numpy()
    int8_rec = np.empty(C, [("scale", "<f4"), ("codes", "i1", (d,))])
    int8_rec["scale"], int8_rec["codes"] = v8.scale.numpy(), v8.codes.numpy()
    for kind, stored_rows, values in (("float32", x, x), ("int8", int8_rec, as_f32)):
        path = write_checkpoint(tmp_path / kind, {"opt.weight.velocity": (kind, stored_rows)}, 2)
        mine = ckpt.load_head_rows_into(path, "opt.weight.velocity", 0,
                                       Int4Rows.zeros([C, d], "int4_log"))
        want = oracle_records(values, "int4_log")
        np.testing.assert_array_equal(mine.codes.numpy(), want["codes"], err_msg=kind)
        np.testing.assert_array_equal(mine.scale.numpy(), want["scale"], err_msg=kind)


def test_a_log_map_velocity_loads_into_the_linear_map_to_nearest(tmp_path):
    """A checkpoint whose velocity is `int4_log` (written before SGD's momentum became the
    linear `int4`) loads into the run's `int4` rows as its values rounded to nearest on the
    linear map (this file's oracle), and the resume's log line names both maps."""
    import plsc.checkpoint as ckpt
    from dtypes.test_checkpoint import C, write_checkpoint
    from plsc.train.checkpointing import state_dtype_note
    x = rows(n=C, d=2 * B, seed=11)
    rec = oracle_records(x, "int4_log")
    path = write_checkpoint(tmp_path / "ck", {"opt.weight.velocity": ("int4_log", rec)}, 2)
    mine = ckpt.load_head_rows_into(path, "opt.weight.velocity", 0, Int4Rows.zeros([C, 2 * B]))
    assert storage_name(mine) == "int4"
    logged = values_of(rec["codes"], rec["scale"], "int4_log", 2 * B).astype(np.float32)
    want, edge = oracle_index(logged, "int4")  # edge: ties such as 2^-1 · 7 = 3.5
    got = oracle_unpack(mine.codes.numpy(), "int4")
    np.testing.assert_array_equal(got[~edge], want[~edge])
    assert (np.abs(got - want) <= 1).all() and edge.mean() < 0.1
    np.testing.assert_array_equal(mine.scale.numpy(), oracle_scales(logged))
    assert state_dtype_note({"opt.weight.velocity": "int4_log"},
                            {"opt.weight.velocity": "int4"}) == (
        "head optimizer state: checkpoint has int4_log (velocity), this run stores int4: "
        "converted on load")
