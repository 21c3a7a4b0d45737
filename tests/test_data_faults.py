"""Bad data never hangs a run: every loader mode and every rank ends with one line and status 65,
or, with Data.skip_bad, skips the sample, logs it and finishes. Each run is a subprocess killed
(SIGKILL) after a time limit, so a regression fails here instead of stalling the suite."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import cv2
import numpy as np
import pytest
import yaml

from face_folders import write_faces

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(os.path.dirname(HERE), "tools", "train.py")
DATA_ERROR = 65
LIMIT = 120  # seconds before a run counts as hung (each takes a few seconds)
IMAGE = 16


def run(cmd, cwd, limit=LIMIT, **kw):
    """(exit status, stdout + stderr, seconds) of `cmd`, SIGKILLed after `limit` seconds."""
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=limit, **kw)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{cmd[-4:]}: still running after {limit} s (hang): {(err.stderr or b'')[-2000:]}")
    return proc.returncode, proc.stdout + proc.stderr, time.time() - start


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """8 identities of 4 images (one of them 10 bytes of text named .jpg): 32 files."""
    return write_faces(tmp_path_factory.mktemp("faces"), size=IMAGE, undecodable=(3, 3))


def write_config(tmp, root, dataset="folder", **data):
    raw = {"Global": {"seed": 0, "output_dir": str(tmp / "out"), "device": "cpu", "max_steps": 8,
                      "log_interval": 1},
           "Model": {"name": "IResNetTiny", "embedding_size": 16},
           "Loss": {"margin": "cosface", "scale": 16.0, "m3": 0.2, "num_classes": 8},
           "Data": dict({"dataset": dataset, "root": root, "image_size": [IMAGE, IMAGE],
                         "batch_size": 4, "num_workers": 0}, **data),
           "Optimizer": {"lr": 0.05},
           "Checkpoint": {"interval": 100},
           "Logging": {"visualdl": False, "progress_bar": False}}
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("workers", [0, 2])
def test_undecodable_image_ends_one_process_with_one_line(tmp_path, folder, workers):
    cfg = write_config(tmp_path, folder, num_workers=workers)
    code, out, seconds = run([sys.executable, TRAIN, "-c", cfg], str(tmp_path))
    assert code == DATA_ERROR, out[-3000:]
    lines = error_lines(out)
    assert len(lines) == 1 and "notes.jpg" in lines[0] and "cannot decode" in lines[0], out[-3000:]
    assert "Traceback" not in out
    assert seconds < 60


def test_undecodable_image_on_one_rank_stops_both(tmp_path, folder, run_ranks):
    cfg = write_config(tmp_path, folder, num_workers=1)
    start = time.time()
    done = run_ranks(TRAIN, 2, ["-c", cfg], cwd=str(tmp_path), timeout=LIMIT)
    seconds = time.time() - start
    assert done.status == DATA_ERROR, done.tail()
    texts = done.logs
    own = [t for t in texts if any("notes.jpg" in line for line in error_lines(t))]
    assert len(own) == 1, [t[-1500:] for t in texts]
    bad_rank = texts.index(own[0])
    other = texts[1 - bad_rank]
    lines = error_lines(other)
    assert len(lines) == 1 and f"rank {bad_rank} stopped on a data error" in lines[0], other[-2000:]
    assert "stopped answering" not in other and "Traceback" not in other + own[0]
    assert seconds < 90


def test_skip_bad_replaces_logs_and_finishes(tmp_path, folder):
    cfg = write_config(tmp_path, folder, skip_bad=1, num_workers=2)
    code, out, _ = run([sys.executable, TRAIN, "-c", cfg, "-o", "Global.max_steps=10"], str(tmp_path))
    assert code == 0, out[-3000:]
    skips = [line for line in out.splitlines() if "skipped bad sample" in line]
    # epochs 0 and 1 (8 batches each) both meet the file once: one line each, none twice
    assert len(skips) == 2 and all("notes.jpg" in line and "1 of at most 1" in line for line in skips), out
    assert "epoch 0" in skips[0] and "epoch 1" in skips[1]


def test_more_bad_samples_than_skip_bad_stops(tmp_path, folder):
    bad = tmp_path / "faces"
    subprocess.run(["cp", "-r", folder, str(bad)], check=True)
    (bad / "id5" / "0.png").write_bytes(b"\x89PNG broken")
    cfg = write_config(tmp_path, str(bad), skip_bad=1)
    code, out, _ = run([sys.executable, TRAIN, "-c", cfg], str(tmp_path))
    assert code == DATA_ERROR, out[-3000:]
    lines = error_lines(out)
    assert len(lines) == 1 and "more than Data.skip_bad=1 bad samples in epoch 0" in lines[0], out


_LOADER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from plsc.data import DataLoader
    mode, workers = sys.argv[1], int(sys.argv[2])

    class Data:
        def __len__(self):
            return 40
        def __getitem__(self, i):
            if i == 13 and mode == "raise":
                raise KeyError("boom")
            if i == 13 and mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            return np.full((2,), i, np.float32), i

    seen = []
    for x, y in DataLoader.sequential(Data(), 4, num_workers=workers):
        seen += y.numpy().tolist()
    print("done", seen == list(range(40)))
""")


@pytest.mark.parametrize("mode,workers", [("raise", 0), ("raise", 2), ("die", 2), ("ok", 2)])
def test_loader_turns_any_failure_into_a_data_error(tmp_path, mode, workers):
    code, out, _ = run([sys.executable, "-c", _LOADER, mode, str(workers)], str(tmp_path), limit=60)
    if mode == "ok":
        assert code == 0 and "done True" in out, out
        return
    error = "DataError" if mode == "raise" else "WorkerDied"  # a DataError too
    assert code == 1 and f"plsc.data.errors.{error}" in out, out[-2000:]
    if mode == "raise":
        assert "KeyError while loading samples 12..15: 'boom'" in out
    else:
        assert "a data loader worker died" in out and "killed by signal 9" in out


# A worker killed while it writes a batch larger than the pipe buffer (64 KiB): before, the
# main process read the rest of the message without a timeout and waited forever. The test
# hook PLSC_TEST_PAUSE_WRITE_AT=<batch>:<file> makes the worker sending <batch> write half of
# its message, write its pid to <file> and sleep, so the kill lands mid-message every time.
PAUSE_HOOK = "PLSC_TEST_PAUSE_WRITE_AT"

_KILL_MID_WRITE = textwrap.dedent("""
    import faulthandler, json, multiprocessing, os, signal, sys, threading, time
    import numpy as np
    from plsc.data import DataError, DataLoader
    reps, limit, folder, hook = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
    BATCH = 8  # 8 x 112 x 112 x 3 bytes = 301 KB a batch
    images = np.random.default_rng(0).integers(0, 255, (6 * BATCH, 112, 112, 3), dtype=np.uint8)

    class Images:
        def __len__(self):
            return len(images)
        def __getitem__(self, i):
            return images[i], i

    def kill_when_paused(path, killed):
        while not os.path.exists(path):
            time.sleep(0.01)
        pid = int(open(path).read())
        parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        killed.update(pid=pid, worker=parent == os.getpid(), at=time.time())
        os.kill(pid, signal.SIGKILL)

    report = []
    for rep in range(reps):
        faulthandler.dump_traceback_later(limit, exit=True)  # a hung repetition ends us here
        at, path, killed = rep % 5, os.path.join(folder, f"paused{rep}"), {}
        os.environ[hook] = f"{at}:{path}"
        threading.Thread(target=kill_when_paused, args=(path, killed), daemon=True).start()
        labels, same, error = [], True, None
        try:
            for x, y in DataLoader.sequential(Images(), BATCH, num_workers=2):
                same &= bool((x.numpy() == images[len(labels):len(labels) + BATCH]).all())
                labels += y.numpy().tolist()
        except DataError as err:
            error = str(err)
        seconds = time.time() - killed["at"] if "at" in killed else None
        faulthandler.cancel_dump_traceback_later()
        report.append(dict(at=at, labels=labels, same=same, error=error, seconds=seconds,
                           pid=killed.get("pid"), worker=killed.get("worker"),
                           left=len(multiprocessing.active_children())))
    print(json.dumps(report), flush=True)
""")


def test_worker_killed_while_writing_a_batch_is_a_data_error_every_time(tmp_path):
    """20 loaders in one process, each with a worker SIGKILLed half-way through writing a batch
    of 301 KB: each ends in a DataError naming that pid within seconds (a hang ends the child
    after 20 s), after a correct prefix of the batches, with no worker left."""
    reps = 20
    code, out, _ = run([sys.executable, "-c", _KILL_MID_WRITE, str(reps), "20", str(tmp_path),
                        PAUSE_HOOK], str(tmp_path), limit=240)
    assert code == 0, out[-3000:]
    report = json.loads([line for line in out.splitlines() if line.startswith("[")][-1])
    assert len(report) == reps
    for r in report:
        assert r["pid"] is not None and r["worker"], r  # the hook paused a child of the loader
        assert r["error"] is not None and f"pid {r['pid']} killed by signal 9" in r["error"], r
        assert r["error"].startswith("a data loader worker died"), r
        assert r["seconds"] < 10, r
        # the batches before the killed one, in order, unless the death ended the run first
        assert r["same"] and r["labels"] == list(range(len(r["labels"]))), r
        assert len(r["labels"]) <= 8 * r["at"], r
        assert r["left"] == 0, r


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    """8 identities of 4 decodable images: 32 files."""
    return write_faces(tmp_path_factory.mktemp("good_faces"), size=IMAGE, seed=1)


@pytest.mark.parametrize("signame", ["KILL", "TERM"])
def test_training_with_a_worker_killed_mid_batch_ends_with_one_line(tmp_path, good_folder,
                                                                   signame):
    """tools/train.py, two workers, batches of 8 x 3 x 48 x 48 float32 (221 KB): the worker
    sending batch 2 is killed half-way through writing it, by SIGKILL (what the kernel's
    out-of-memory killer sends) or by SIGTERM alone (the hook gives it SIGTERM's default
    action back; the main process has no stop pending); the run ends with 65 and one line
    naming that worker and the signal, with the memory advice for SIGKILL only."""
    cfg = write_config(tmp_path, good_folder, num_workers=2, batch_size=8, image_size=[48, 48])
    paused, log = tmp_path / "paused", tmp_path / "log.txt"
    env = dict(os.environ, **{PAUSE_HOOK: f"2:{paused}"})
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, TRAIN, "-c", cfg], cwd=str(tmp_path), env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + LIMIT
        while not paused.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert paused.exists(), f"no worker paused at batch 2: {log.read_text()[-3000:]}"
        pid = int(paused.read_text())
        os.kill(pid, getattr(signal, "SIG" + signame))
        killed = time.time()
        code = proc.wait(timeout=LIMIT)
        seconds = time.time() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == DATA_ERROR, text[-3000:]
    lines = error_lines(text)
    signum = getattr(signal, "SIG" + signame)
    assert len(lines) == 1 and (f"a data loader worker died (pid {pid} killed by signal "
                                f"{signum} (SIG{signame}))") in lines[0], text
    assert ("if it ran out of memory, lower Data.num_workers" in lines[0]) == (signame == "KILL")
    assert "Traceback" not in text
    assert seconds < 30, seconds


# ------------------------------------------------------------- damaged RecordIO and packs
@pytest.fixture(scope="module")
def rec_root(tmp_path_factory):
    from trainer_common import make_data
    return make_data(str(tmp_path_factory.mktemp("synthetic")))


def _first_key(root):
    """The record key of the first sample of epoch 0 (seed 0, one rank, batch 4)."""
    from plsc.data import DistributedBatchSampler, RecordIODataset
    ds = RecordIODataset(root, train=False)
    first = DistributedBatchSampler(len(ds), 4, 0, 1, shuffle=True, seed=0).indices()[0]
    return int(ds.keys[first]), ds


def _damage(src, dst, kind):
    """Copy the synthetic set `src` to `dst` with `kind` of damage; what names it in an error."""
    subprocess.run(["cp", "-r", src, dst], check=True)
    key, ds = _first_key(dst)
    offset = int(ds.reader.offsets[list(ds.reader.keys).index(key)])
    rec = os.path.join(dst, "train.rec")
    if kind == "magic":  # the record's magic number
        with open(rec, "r+b") as f:
            f.seek(offset)
            f.write(b"\0\0\0\0")
        return f"key {key}"
    if kind == "length":  # the record's length word: far past the next record
        with open(rec, "r+b") as f:
            f.seek(offset + 4)
            f.write((0x1FFFFFFF).to_bytes(4, "little"))
        return f"key {key}"
    if kind == "image":  # bytes inside the JPEG: may still decode
        with open(rec, "r+b") as f:
            f.seek(offset + 8 + 24 + 40)
            f.write(bytes(64))
        return None
    if kind == "rec":
        os.truncate(rec, os.path.getsize(rec) // 2)
        return "past the end"
    if kind == "idx":
        idx = os.path.join(dst, "train.idx")
        text = open(idx).read()
        open(idx, "w").write(text[:len(text) // 2] + "12x\n")
        return "train.idx"
    if kind == "bin":
        path = os.path.join(dst, "val.bin")
        os.truncate(path, os.path.getsize(path) // 2)
        return "val.bin"
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["magic", "length", "image", "rec", "idx", "bin"])
def test_damaged_rec_idx_and_bin_end_in_one_line(tmp_path, rec_root, kind):
    root = str(tmp_path / "data")
    named = _damage(rec_root, root, kind)
    cfg = write_config(tmp_path, root, dataset="recordio")
    extra = ["-o", "Loss.num_classes=24", "-o", "Global.max_steps=2"]
    if kind == "bin":
        extra += ["-o", f"Eval.root={root}", "-o", "Eval.targets=[val]", "-o", "Eval.interval=1"]
    code, out, _ = run([sys.executable, TRAIN, "-c", cfg] + extra, str(tmp_path))
    assert "Traceback" not in out, out[-3000:]
    if named is None:  # flipped image bytes: a clear error or a normal finish
        assert code in (0, DATA_ERROR), out[-3000:]
        assert code == 0 or len(error_lines(out)) == 1
        return
    assert code == DATA_ERROR, out[-3000:]
    lines = error_lines(out)
    assert len(lines) == 1 and named in lines[0], out[-3000:]
    if kind in ("magic", "length"):  # a record can be skipped instead
        code, out, _ = run([sys.executable, TRAIN, "-c", cfg, "-o", "Data.skip_bad=1"] + extra,
                           str(tmp_path))
        assert code == 0, out[-3000:]
        assert [named in line for line in out.splitlines() if "skipped bad sample" in line] == [True]


@pytest.mark.parametrize("stop_at,counted,prefetch", [(1, 0, False), (3, 1, False), (1, 0, True)])
def test_skip_bad_resume_equals_uninterrupted(tmp_path, folder, stop_at, counted, prefetch):
    """A run stopped (SIGTERM) in epoch 0 before (step 1: the skip is in the batch loaded for a
    step not taken) or after its skip (step 3) and resumed with Global.checkpoint: auto ends with
    the uninterrupted run's weights and skip counts, the bad file replaced in both epochs; also
    with Data.device_prefetch (the batch after the step, and its skip, loaded ahead)."""
    import signal

    from plsc.config import load_config
    from plsc.data import DistributedBatchSampler
    from plsc.train import Trainer
    from plsc.train.preemption import Preempted

    # a copy where the bad sample is the one epoch 0 meets at step 2 (notes.jpg made good)
    root = tmp_path / "faces"
    subprocess.run(["cp", "-r", folder, str(root)], check=True)
    order = DistributedBatchSampler(32, 4, 0, 1, shuffle=True, seed=0).indices().tolist()
    bad = order[5]
    cv2.imwrite(str(root / "id3" / "good.png"), np.full((IMAGE, IMAGE, 3), 9, np.uint8))
    os.replace(root / "id3" / "good.png", root / "id3" / "notes.jpg")
    name = "notes.jpg" if bad == 15 else f"{bad % 4}.png"
    (root / f"id{bad // 4}" / name).write_bytes(b"broken")
    folder = str(root)

    def cfg(name):
        path = write_config(tmp_path, folder, skip_bad=2, device_prefetch=prefetch)
        return load_config(path, [f"Global.output_dir={tmp_path / name}", "Global.max_steps=12",
                                  "Global.checkpoint=auto"])

    full = Trainer(cfg("full"))
    full.train()
    assert full.skipped_total == 2 and full.skipped_in_epoch == 1  # once per epoch
    stopped = Trainer(cfg("stopped"))
    real = stopped._after_step

    def after_step():
        real()
        if stopped.step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
    stopped._after_step = after_step
    with pytest.raises(Preempted):
        stopped.train()
    assert (stopped.skipped_in_epoch, stopped.skipped_total) == (counted, counted)
    resumed = Trainer(cfg("stopped"))
    assert resumed.step == stop_at
    assert (resumed.skipped_in_epoch, resumed.skipped_total) == (counted, counted)  # checkpointed
    resumed.train()
    assert (resumed.skipped_in_epoch, resumed.skipped_total) == (1, 2)
    for a, b in zip(full.backbone.parameters(), resumed.backbone.parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(full.head.weight.numpy(), resumed.head.weight.numpy())


def test_a_sigterm_while_the_interpreter_shuts_down_keeps_the_data_error_status(tmp_path):
    """The launcher SIGTERMs the other ranks once one exits; a rank already winding down with
    status 65 must end with 65 even when the signal comes while the interpreter finalises its
    modules (Paddle's teardown), where Python handlers no longer run: a child process with a
    slow finaliser is signalled inside it (seen in CI: the launcher reported -15)."""
    import signal
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent("""
        import sys, time
        from plsc.cli import _keep_status_on_sigterm
        class Slow:
            def __del__(self):
                print("finalising", flush=True)
                end = time.time() + 3
                while time.time() < end:
                    pass
        keep = Slow()
        _keep_status_on_sigterm(65)
        sys.exit(65)
    """))
    proc = subprocess.Popen([sys.executable, str(child)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "finalising"
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == DATA_ERROR
