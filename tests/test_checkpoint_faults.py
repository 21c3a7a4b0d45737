"""Checkpoints broken on purpose: cut and flipped files, a full disk, leftovers of a crash.
Damage must give one clear error naming the file or a fall-back to the newest intact
checkpoint, never a resume from damaged state; a failed save exits with status 74."""
import glob
import json
import os
import shutil
import subprocess

import numpy as np
import paddle
import pytest
import yaml

import scripts
from trainer_common import CLASSES, IMAGE, checked_closing_block, config, make_data
from plsc.train import Trainer
from plsc.checkpoint import (IO_ERROR_EXIT_CODE, CheckpointDamaged, reshard_checkpoint,
                                    verify_checkpoint)
from plsc.fileio import AtomicWriter, remove_leftovers

HERE = os.path.dirname(os.path.abspath(__file__))
LIMIT = 150  # seconds before a subprocess is killed (SIGKILL): a hang fails, never stalls


def _crc32_table():
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32_table()


def crc32(data):
    """CRC-32 (IEEE, reflected), byte by byte: an oracle independent of zlib."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return f"{c ^ 0xFFFFFFFF:08x}"


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("synthetic")))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, data_root):
    """An output folder with intact checkpoints at steps 3 and 6."""
    out = str(tmp_path_factory.mktemp("pristine") / "run")
    Trainer(config(data_root, out)).train()
    return out


def step_dir(out, step):
    return os.path.join(out, "checkpoints", f"step_{step:08d}")


def copy_run(pristine, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(pristine, out)
    return out


def truncate(file):
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


def flip(file):
    """Flip the bits of one byte near the end (the data, not the header)."""
    with open(file, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def resume(data_root, out, checkpoint="auto", verify="full"):
    return Trainer(config(data_root, out, Global={"checkpoint": checkpoint},
                          Checkpoint={"verify": verify}))


def log_of(out):
    return open(os.path.join(out, "train.log")).read()


# ------------------------------------------------------------------ the writer
def test_writer_records_what_is_on_disk_and_is_all_or_nothing(tmp_path):
    path = str(tmp_path / "a.bin")
    with AtomicWriter(path) as f:
        f.write(b"x" * 1000)
        f.write("é-text")
    data = open(path, "rb").read()
    assert f.record == (len(data), crc32(data)) and data.endswith("é-text".encode())
    with pytest.raises(RuntimeError), AtomicWriter(path) as f:
        f.write(b"new bytes")
        raise RuntimeError("the producer failed")
    assert open(path, "rb").read() == data  # the old file, whole
    assert os.listdir(tmp_path) == ["a.bin"]  # no temporary file left


def test_leftovers_of_dead_writers_of_that_file_only_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid no process has now
    names = [f"a.bin.{dead.pid}.part", f"a.bin.{os.getpid()}.part", f"b.bin.{dead.pid}.part",
             f"a.bin.{dead.pid}.tmp", "a.bin.x.part", "a.bin"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    remove_leftovers(tmp_path / "a.bin")
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])


def test_manifest_lists_every_file_with_its_size_and_checksum(pristine):
    folder = step_dir(pristine, 6)
    manifest = json.load(open(os.path.join(folder, "manifest.json")))["files"]
    on_disk = sorted(os.path.relpath(p, folder) for p in glob.glob(f"{folder}/**", recursive=True)
                     if os.path.isfile(p))
    assert sorted([*manifest, "manifest.json"]) == on_disk
    for name, rec in manifest.items():
        data = open(os.path.join(folder, name), "rb").read()
        assert rec["size"] == len(data), name
        if len(data) < 50_000:  # the pure-Python oracle is slow
            assert rec["crc32"] == crc32(data), name


# ------------------------------------------------------------- damaged resumes
@pytest.mark.parametrize("damage,file,verify", [
    (truncate, "head_rank0/weight.npy", "full"),
    (flip, "head_rank0/opt.weight.velocity.npy", "full"),
    (truncate, "meta.json", "full"),
    (truncate, "backbone.pdparams", "full"),
    (flip, "trainer.pdstates", "full"),
    (os.remove, "manifest.json", "full"),
    (truncate, "head_rank0/weight.npy", "size"),
])
def test_damaged_newest_falls_back_to_the_intact_one(tmp_path, data_root, pristine, damage,
                                                     file, verify):
    out = copy_run(pristine, tmp_path)
    damage(os.path.join(step_dir(out, 6), file))
    trainer = resume(data_root, out, verify=verify)
    assert trainer.step == 3
    stored = np.load(os.path.join(step_dir(out, 3), "head_rank0", "weight.npy"))
    np.testing.assert_array_equal(trainer.head.weight.numpy(), stored)
    log = log_of(out)
    assert f"checkpoint step_00000006 is damaged and is skipped: damaged checkpoint file " \
           f"{os.path.join(step_dir(out, 6), file)}" in log
    assert f"resuming from {step_dir(out, 3)}" in log


@pytest.mark.parametrize("file", ["head_rank0/weight.npy", "meta.json", "backbone.pdparams"])
def test_cut_files_give_a_clear_error_even_unverified(tmp_path, data_root, pristine, file):
    out = copy_run(pristine, tmp_path)
    truncate(os.path.join(step_dir(out, 6), file))
    with pytest.raises(CheckpointDamaged) as info:
        resume(data_root, out, verify="none")
    assert str(info.value).startswith(f"damaged checkpoint file {step_dir(out, 6)}/{file}: ")


def test_damaged_explicit_path_and_the_verify_tool(tmp_path, data_root, pristine, capsys):
    tool = scripts.load("tools/checkpoint.py")
    out = copy_run(pristine, tmp_path)
    weight = os.path.join(step_dir(out, 6), "head_rank0", "weight.npy")
    assert tool.main(["verify", step_dir(out, 6)]) == 0
    assert capsys.readouterr().out == f"OK {step_dir(out, 6)}\n"
    flip(weight)
    with pytest.raises(CheckpointDamaged, match=f"^damaged checkpoint file {weight}: CRC-32 "):
        resume(data_root, out, checkpoint=step_dir(out, 6))
    assert tool.main(["verify", step_dir(out, 6)]) == 65
    assert tool.main(["verify", "--level", "size", step_dir(out, 6)]) == 0  # same size
    err = capsys.readouterr().err
    assert err.startswith(f"error: damaged checkpoint file {weight}: CRC-32 ") and err.count("\n") == 1


def test_all_damaged_is_an_error_not_a_fresh_start(tmp_path, data_root, pristine):
    out = copy_run(pristine, tmp_path)
    for step in (3, 6):
        truncate(os.path.join(step_dir(out, step), "head_rank0", "weight.npy"))
    with pytest.raises(CheckpointDamaged, match="no intact checkpoint is left under"):
        resume(data_root, out)


def test_checkpoint_without_manifest_gets_size_checks(tmp_path, data_root, pristine):
    out = copy_run(pristine, tmp_path)
    for step in (3, 6):  # as an older plsc wrote them
        os.remove(os.path.join(step_dir(out, step), "manifest.json"))
        meta_file = os.path.join(step_dir(out, step), "meta.json")
        meta = json.load(open(meta_file))
        del meta["manifest"]
        json.dump(meta, open(meta_file, "w"))
    verify_checkpoint(step_dir(out, 6), "full")
    truncate(os.path.join(step_dir(out, 6), "head_rank0", "weight.npy"))
    assert resume(data_root, out).step == 3


def test_damaged_backbone_for_eval_and_reshard(tmp_path, data_root, pristine, capsys):
    from plsc.apps.tasks import trained_backbone
    reshard = scripts.load("tools/reshard.py")
    out = copy_run(pristine, tmp_path)
    backbone = os.path.join(step_dir(out, 6), "backbone.pdparams")
    truncate(backbone)
    cfg = config(data_root, out, Global={"checkpoint": "latest"})
    model = trained_backbone(cfg)  # falls back to step 3's backbone
    expect = paddle.load(os.path.join(step_dir(out, 3), "backbone.pdparams"))
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), expect[name].numpy(), err_msg=name)
    assert "checkpoint step_00000006 is damaged" in capsys.readouterr().err
    cfg["Global"]["checkpoint"] = step_dir(out, 6)
    with pytest.raises(CheckpointDamaged, match=f"^damaged checkpoint file {backbone}: "):
        trained_backbone(cfg)
    assert reshard.main([step_dir(out, 6), "--world-size", "2", "--output",
                         str(tmp_path / "two")]) == 65
    assert capsys.readouterr().err.startswith(f"error: damaged checkpoint file {backbone}: ")
    assert not os.path.exists(tmp_path / "two")


def test_leftovers_of_a_crash_are_removed_at_start(tmp_path, data_root, pristine):
    out = copy_run(pristine, tmp_path)
    made = ["checkpoints/step_00000009.tmp", "best_lfw.tmp", "best_lfw.old"]
    for d in made:
        os.makedirs(os.path.join(out, d, "head_rank0"))
        open(os.path.join(out, d, "head_rank0", "weight.npy"), "wb").close()
    for f in ("checkpoints/latest.4242.part", "checkpoints/step_00000009.tmp.part"):
        open(os.path.join(out, f), "wb").close()
    before = sorted(os.listdir(os.path.join(out, "checkpoints")))
    resume(data_root, out)
    after = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert after == ["latest", "step_00000003", "step_00000006"], (before, after)
    assert not any(os.path.exists(os.path.join(out, d)) for d in made)
    lines = [line for line in log_of(out).splitlines() if "leftover(s)" in line]
    assert len(lines) == 1 and "removed 5 leftover(s) of an interrupted save" in lines[0]
    assert "checkpoints/step_00000009.tmp" in lines[0] and "best_lfw.old" in lines[0]


# ------------------------------------------------------------- full disks (subprocesses)
def write_config(path, data_root, out, max_steps, **sections):
    raw = {"Global": {"seed": 0, "output_dir": out, "device": "cpu", "max_steps": max_steps,
                      "log_interval": 1, "checkpoint": "auto"},
           "Model": {"name": "IResNetTiny", "embedding_size": 32},
           "Loss": {"margin": "arcface", "scale": 16.0, "num_classes": CLASSES},
           "Data": {"dataset": "recordio", "root": data_root, "image_size": [IMAGE, IMAGE],
                    "batch_size": 4, "num_workers": 0},
           "Optimizer": {"lr": 0.05, "momentum": 0.9},
           "Checkpoint": {"interval": 3, "keep_last": 5},
           "Logging": {"visualdl": False, "progress_bar": False}}
    for sec, values in sections.items():
        raw[sec].update(values)
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return path


def plsc_lines(text):
    return [line for line in text.splitlines() if line.startswith("plsc: ")]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs (one 2.6 MB checkpoint fits, two do not), or None where mounting fails."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        yield None
        return
    try:
        yield str(disk)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_full_disk_stops_with_one_line_and_status_74(tmp_path, data_root, small_disk, run_ranks):
    if small_disk is None:
        pytest.skip("cannot mount a tmpfs here (the simulated ENOSPC test still runs)")
    out = os.path.join(small_disk, "out")
    cfg = write_config(str(tmp_path / "c.yaml"), data_root, out, 6)
    worker = os.path.join(HERE, "fault_worker.py")
    done = run_ranks(worker, 1, ["-c", cfg], cwd=str(tmp_path), timeout=LIMIT)
    code, text = done.status, done.output  # the check before writing stops it
    assert code == IO_ERROR_EXIT_CODE, text[-3000:]
    (line,) = plsc_lines(text)
    assert line.startswith("plsc: checkpoint step 6 not written: it needs 2.") and " MB free; " in line
    assert line.endswith(f"the previous checkpoint (step 3, {step_dir(out, 3)}) is intact")
    assert "Traceback" not in text
    checked_closing_block(out, 6, "a checkpoint could not be written", checkpoint_step=3)
    # Without the check the disk fills in the middle of a write: the same kind of line.
    done = run_ranks(worker, 1, ["-c", cfg], cwd=str(tmp_path), env={"FAULT_NO_PRECHECK": "1"},
                     timeout=LIMIT)
    code, text = done.status, done.output
    assert code == IO_ERROR_EXIT_CODE, text[-3000:]
    (line,) = plsc_lines(text)
    assert line.startswith(f"plsc: checkpoint step 6 not written: rank 0 could not write "
                           f"{step_dir(out, 6)}.tmp/") and "No space left on device" in line
    assert "the partial folder was removed" in line and "(step 3," in line
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step_00000003"]
    verify_checkpoint(step_dir(out, 3), "full")


def test_two_ranks_agree_on_fallback_and_on_a_failed_save(tmp_path, data_root, pristine, run_ranks):
    """2 launched ranks: a flipped byte in rank 1's shard of the newest checkpoint makes both
    resume from the older one; a full disk on rank 1 alone makes both exit 74 with the same
    line, no rank left waiting."""
    out = str(tmp_path / "out")
    for step in (3, 6):
        reshard_checkpoint(step_dir(pristine, step), step_dir(out, step), 2)
    damaged = os.path.join(step_dir(out, 6), "head_rank1", "weight.npy")
    flip(damaged)
    cfg = write_config(str(tmp_path / "c.yaml"), data_root, out, 9)
    done = run_ranks(os.path.join(HERE, "fault_worker.py"), 2, ["-c", cfg], cwd=str(tmp_path),
                     env={"FAULT_ENOSPC": "1:step_00000009"}, timeout=LIMIT)
    ranks = done.logs
    assert done.status == IO_ERROR_EXIT_CODE, done.tail(2000)
    assert f"damaged checkpoint file {damaged}: CRC-32" in ranks[0]
    assert f"resumed from {step_dir(out, 3)} at step 3" in ranks[0]
    lines = [plsc_lines(t)[-1] for t in ranks]
    assert lines[0] == lines[1], lines
    assert lines[0].startswith(f"plsc: checkpoint step 9 not written: rank 1 could not write "
                               f"{step_dir(out, 9)}.tmp/")
    assert f"(step 6, {step_dir(out, 6)}) is intact" in lines[0]
    assert not os.path.exists(step_dir(out, 9) + ".tmp")
    verify_checkpoint(step_dir(out, 6), "full")  # rewritten by the resumed run
