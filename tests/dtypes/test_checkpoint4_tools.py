"""tools/reshard.py on checkpoints whose head optimizer state is 4-bit, written by short training
runs (SGD with int8 centres, 2 sub-centres and Partial FC; dense AdamW with float32 centres
and a bias): re-sharding 1 -> 2 -> 3 ranks, --export, --dtype float32 and --import, each
checked against the records decoded in numpy by tests/dtypes/test_quantized4.py's oracle (the
documented tables, nibble order and block scales), and the results resumed by the trainer.
Sub-centre cleaning of a 4-bit-state checkpoint: tests/test_clean_subcenters.py."""
import os

import numpy as np
import pytest

import scripts
from dtypes import test_quantized as q8, test_quantized4 as q4
from trainer_common import CLASSES, config, head_bits, assert_same_bits, make_backbone, make_data
import plsc.checkpoint as ckpt
from plsc.train import Trainer

RUNS = {"sgd": dict(Loss={"param_dtype": "int8", "sample_ratio": 0.5, "sub_centers": 2},
                    Optimizer={"name": "sgd", "head_state_dtype": "int4"}),
        "adamw": dict(Loss={"margin": "softmax"},
                      Optimizer={"name": "adamw", "lr": 0.01, "head_state_dtype": "int4"})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run: (its step-3 checkpoint, its trainer after 3 steps)}."""
    base = tmp_path_factory.mktemp("ckpt4")
    root = make_data(str(base / "data"))
    out = {}
    for name, sections in RUNS.items():
        trainer = Trainer(config(root, str(base / name), Global={"max_steps": 3}, **sections),
                          backbone=make_backbone(0))
        trainer.train()
        out[name] = (os.path.join(str(base / name), "checkpoints", "step_00000003"), trainer)
    out["data"] = root
    return out


def decoded(rows, stored):
    """float32 values of head rows as a checkpoint stores them (`stored`: head dtype), decoded
    here: 4 bits by test_quantized4's oracle, 8-bit log maps by test_quantized's; floats as they
    are."""
    if not rows.dtype.names:
        return rows
    flat = rows.reshape(-1)
    if stored in q4.NAMES:
        d = 2 * flat["codes"].shape[-1]
        v = q4.values_of(flat["codes"], flat["scale"], stored, d)
    elif stored == "int8":  # docs/checkpoints.md's formula, in float32
        d = flat["codes"].shape[-1]
        v = flat["codes"] * (flat["scale"][:, None] / np.float32(127))
    else:
        d = flat["codes"].shape[-1]
        v = q8.value_of(flat["codes"], flat["scale"], stored)
    return v.astype(np.float32).reshape(rows.shape + (d,))


def all_rows(path, name, world):
    """Head array `name` of checkpoint `path` from its `world` rank files, concatenated."""
    return np.concatenate([np.load(os.path.join(path, f"head_rank{r}", f"{name}.npy"))
                           for r in range(world)])


def four_bit(meta):
    names = [n for n, d in meta["head_dtypes"].items() if d in q4.NAMES]
    assert names
    return names


def resume(runs, run, path, **sections):
    merged = {k: dict(v) for k, v in RUNS[run].items()}
    for sec, values in sections.items():
        merged.setdefault(sec, {}).update(values)
    out = os.path.join(os.path.dirname(path), "resumed_" + os.path.basename(path))
    trainer = Trainer(config(runs["data"], out, Global={"checkpoint": path, "max_steps": 4},
                             **merged), backbone=make_backbone(1))
    log = open(os.path.join(out, "train.log")).read()
    return trainer, [line for line in log.splitlines() if "head optimizer state" in line]


@pytest.mark.parametrize("run", sorted(RUNS))
def test_reshard_tool_1_to_2_to_3_ranks(runs, run, tmp_path):
    """The 4-bit records are copied bit for bit through 2 and 3 ranks; the rows decoded from
    the 2-rank and the 3-rank shards are the same and are the run's state's values; the
    3-rank checkpoint resumed in one process holds the run's head bits."""
    src, trainer = runs[run]
    reshard = scripts.load("tools/reshard.py")
    two, three = str(tmp_path / "two"), str(tmp_path / "three")
    assert reshard.main([src, "--world-size", "2", "--output", two]) == 0
    assert reshard.main([two, "--world-size", "3", "--output", three]) == 0
    meta = ckpt.read_meta(src)
    for path, world in ((two, 2), (three, 3)):
        ckpt.verify_checkpoint(path)
        assert ckpt.read_meta(path)["head_dtypes"] == meta["head_dtypes"]
        assert ckpt.read_meta(path)["world_size"] == world
    for name in four_bit(meta):
        stored = meta["head_dtypes"][name]
        original = all_rows(src, name, 1)
        halves, thirds = all_rows(two, name, 2), all_rows(three, name, 3)
        assert halves.tobytes() == thirds.tobytes() == original.tobytes(), name
        assert np.load(os.path.join(three, "head_rank2", f"{name}.npy")).shape[0] == CLASSES // 3
        values = decoded(thirds, stored)
        np.testing.assert_array_equal(decoded(halves, stored), values, err_msg=name)
        state = trainer.head_opt.state_dict()[name[len("opt."):]]
        want = q4.values_of(state.codes.numpy().reshape(-1, state.codes.shape[-1]),
                            state.scale.numpy().reshape(-1, state.scale.shape[-1]), stored,
                            state.shape[-1]).astype(np.float32)
        np.testing.assert_array_equal(values.reshape(want.shape), want, err_msg=name)
        assert np.abs(values).max() > 0
    resumed, notes = resume(runs, run, three)
    assert resumed.step == 3 and notes == []
    assert_same_bits(head_bits(resumed)[0], head_bits(trainer)[0])


@pytest.mark.parametrize("run", sorted(RUNS))
def test_export_tool_writes_the_decoded_values(runs, run, tmp_path):
    """--export of every head array: a 4-bit state array (and the int8 weight) as its float32
    values decoded here, [C, K, d] with K sub-centres; float32 arrays as stored."""
    src, _ = runs[run]
    reshard = scripts.load("tools/reshard.py")
    meta = ckpt.read_meta(src)
    k = meta["sub_centers"]
    for name, stored in meta["head_dtypes"].items():
        out = str(tmp_path / f"{name}.npy")
        assert reshard.main([src, "--export", out, "--array", name]) == 0
        got = np.load(out)
        want = decoded(np.load(os.path.join(src, "head_rank0", f"{name}.npy")), stored)
        assert got.dtype == np.float32 and got.shape == want.shape, name
        if name == "weight" or name.startswith("opt.weight.m") or name.endswith("t.velocity"):
            assert got.shape[:2] == ((CLASSES, k) if k > 1 else (CLASSES, 32)), name
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_dtype_tool_gives_float32_values_and_they_resume_as_the_same_4_bits(runs, run, tmp_path):
    """--dtype float32 stores each 4-bit array as its decoded values (float32 arrays as they
    were) and says so in the stored config; a run with 4-bit state resumed from it logs the
    conversion and holds the original codes and scales bit for bit (each decoded value is
    its own nearest 4-bit value)."""
    src, trainer = runs[run]
    reshard = scripts.load("tools/reshard.py")
    f32 = str(tmp_path / "f32")
    assert reshard.main([src, "--dtype", "float32", "--output", f32]) == 0
    ckpt.verify_checkpoint(f32)
    meta, new = ckpt.read_meta(src), ckpt.read_meta(f32)
    assert set(new["head_dtypes"].values()) == {"float32"}
    assert new["config"]["Optimizer"]["head_state_dtype"] is None
    for name, stored in meta["head_dtypes"].items():
        want = decoded(ckpt.load_head_rows(src, name, 0, CLASSES), stored)
        np.testing.assert_array_equal(ckpt.load_head_rows(f32, name, 0, CLASSES), want,
                                      err_msg=name)
    resumed, notes = resume(runs, run, f32)
    states = "moment1, moment2" if run == "adamw" else "velocity"
    assert len(notes) == 1 and notes[0].endswith(
        f"head optimizer state: checkpoint has float32 ({states}), this run stores int4: "
        "converted on load")
    for name in four_bit(meta):
        key = name[len("opt."):]
        a, b = resumed.head_opt.state_dict()[key], trainer.head_opt.state_dict()[key]
        np.testing.assert_array_equal(a.codes.numpy(), b.codes.numpy(), err_msg=name)
        np.testing.assert_array_equal(a.scale.numpy(), b.scale.numpy(), err_msg=name)


def test_import_tool_restarts_the_4_bit_state_at_zero(runs, tmp_path):
    """--import of new centres into the SGD run's checkpoint: the int8 weight is the new
    values quantised, the 4-bit momentum of the replaced weight is zero records (as 8-bit state
    is), and a run resumes from it and trains."""
    src, _ = runs["sgd"]
    reshard = scripts.load("tools/reshard.py")
    rng = np.random.RandomState(0)
    new = rng.normal(size=(CLASSES, 2, 32)).astype(np.float32)
    np.save(str(tmp_path / "new.npy"), new)
    dst = str(tmp_path / "imported")
    assert reshard.main([src, "--import", str(tmp_path / "new.npy"), "--output", dst]) == 0
    meta = ckpt.read_meta(dst)
    assert meta["head_dtypes"] == ckpt.read_meta(src)["head_dtypes"]
    weight = ckpt.load_head_rows(dst, "weight", 0, CLASSES)
    np.testing.assert_array_equal(weight["scale"], np.abs(new).max(axis=2))
    velocity = ckpt.load_head_rows(dst, "opt.weight.velocity", 0, CLASSES)
    assert velocity.shape == (CLASSES, 2) and velocity["codes"].shape == (CLASSES, 2, 16)
    assert not velocity["codes"].any() and not velocity["scale"].any()
    resumed, notes = resume(runs, "sgd", dst)
    assert notes == [] and not resumed.head_opt.state_dict()["weight.velocity"].codes.numpy().any()
    history = resumed.train()
    assert [s for s, _ in history] == [4] and np.isfinite([v for _, v in history]).all()
    assert resumed.head_opt.state_dict()["weight.velocity"].scale.numpy().any()
