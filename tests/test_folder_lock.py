"""One job per output folder (the lock, exit status 73), an unwritable output folder stopped at
start (74), and `checkpoints/latest` repaired at start. The oracle for "held" is the kernel: a
fresh `flock(LOCK_EX | LOCK_NB)` on the lock file from this process, which fails exactly while
some other open file description holds the lock. Every run of a tool is a subprocess killed
after a time limit, so a hang fails here instead of stalling the suite."""
import errno
import fcntl
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import yaml

import scripts
from face_folders import write_faces
from plsc.checkpoint import verify_checkpoint
from plsc.checkpoint import lock as folder_lock
from plsc.checkpoint.lock import FolderInUse, FolderNotWritable, claim_folder
from plsc.config import dump_config
from plsc.fileio import TEST_READ_ONLY_ENV
from plsc.train import Trainer
from processes import alive, children
from trainer_common import config, make_data

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAIN = os.path.join(ROOT, "tools", "train.py")
LIMIT = 120  # seconds before a run counts as hung
IN_USE, IO_ERROR = 73, 74
IMAGE = 16


# ------------------------------------------------------------------ helpers
def run(cmd, cwd, limit=LIMIT, **kw):
    """(exit status, stdout + stderr) of `cmd`, SIGKILLed after `limit` seconds."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=limit, **kw)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{cmd[-4:]}: still running after {limit} s (hang): {(err.stderr or b'')[-2000:]}")
    return proc.returncode, proc.stdout + proc.stderr


def is_locked(folder):
    """Whether some open file description holds the flock of `folder`'s lock file."""
    fd = os.open(os.path.join(folder, ".plsc.lock"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (releases the flock taken here, if any)


class Holder:
    """The lock of `folder` held by this test process, as another job would hold it."""

    def __init__(self, folder, pid=4242, host="elsewhere"):
        os.makedirs(folder, exist_ok=True)
        self.fd = os.open(os.path.join(folder, ".plsc.lock"), os.O_RDWR | os.O_CREAT)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.info = {"host": host, "pid": pid, "started": "2031-02-03T04:05:06+00:00",
                     "command": "tools/train.py -c first.yaml"}
        os.ftruncate(self.fd, 0)
        os.write(self.fd, json.dumps(self.info).encode())

    def close(self):
        os.close(self.fd)


def error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


def step_lines(text):
    return [line for line in text.splitlines() if " step " in f" {line}" and "/" in line
            and " loss " in line]


def load_tool(name):
    return scripts.load(f"tools/{name}.py")


@pytest.fixture(scope="module")
def faces(tmp_path_factory):
    """8 identities of 4 16x16 images."""
    return write_faces(tmp_path_factory.mktemp("faces"), size=IMAGE)


def write_config(tmp, faces, out, max_steps=8, interval=100, **data):
    raw = {"Global": {"seed": 0, "output_dir": str(out), "device": "cpu", "max_steps": max_steps,
                      "log_interval": 1, "checkpoint": "auto"},
           "Model": {"name": "IResNetTiny", "embedding_size": 16},
           "Loss": {"margin": "cosface", "scale": 16.0, "m3": 0.2, "num_classes": 8},
           "Data": dict({"dataset": "folder", "root": faces, "image_size": [IMAGE, IMAGE],
                         "batch_size": 4, "num_workers": 0}, **data),
           "Optimizer": {"lr": 0.05},
           "Checkpoint": {"interval": interval, "keep_last": 2},
           "Logging": {"visualdl": False, "progress_bar": False}}
    path = tmp / f"config{len(list(tmp.glob('config*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


class Reader:
    """The merged output of a running process, line by line, in a thread."""

    def __init__(self, proc):
        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text, limit=LIMIT):
        deadline = time.time() + limit
        while time.time() < deadline:
            if any(text in line for line in self.lines):
                return
            if self.proc.poll() is not None and not self.thread.is_alive():
                break
            time.sleep(0.01)
        self.proc.kill()
        pytest.fail(f"no {text!r} in the output: {''.join(self.lines)[-3000:]}")

    @property
    def text(self):
        return "".join(self.lines)


# ------------------------------------------------------------ the lock itself
def test_lock_names_its_holder_and_outlives_forked_children(tmp_path):
    folder = str(tmp_path / "run")
    lock = claim_folder(folder)
    assert lock.held and is_locked(folder)
    holder = json.load(open(os.path.join(folder, ".plsc.lock")))
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert holder["started"][:4].isdigit()
    assert sorted(os.listdir(folder)) == [".plsc.lock"]  # the probe file was removed
    with pytest.raises(FolderInUse) as info:  # a second claim, even from this process
        claim_folder(folder)
    msg = str(info.value)
    assert msg.startswith(f"{folder} is in use by another job (host {socket.gethostname()}, "
                          f"pid {os.getpid()}, started {holder['started']}") and "\n" not in msg
    # A forked child that releases its copy and exits does not unlock the parent's lock.
    pid = os.fork()
    if pid == 0:
        try:
            lock.release()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert is_locked(folder)
    lock.release()
    lock.release()  # idempotent
    assert not is_locked(folder)


def test_killed_holder_with_a_live_forked_child_frees_the_folder(tmp_path):
    """A process holding the lock forks a child (which lives on) and is killed: the lock is
    free at once, and the next claim gets it."""
    folder = str(tmp_path / "run")
    script = ("import os, signal, sys, time\n"
              "from plsc.checkpoint.lock import claim_folder\n"
              f"lock = claim_folder({folder!r})\n"
              "child = os.fork()\n"
              "if child == 0:\n"
              "    null = os.open(os.devnull, os.O_WRONLY)\n"
              "    os.dup2(null, 1), os.dup2(null, 2)  # (the test reads to the end of output)\n"
              "    time.sleep(60)\n"
              "    os._exit(0)\n"
              "print(child, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=LIMIT)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    child = int(proc.stdout.split()[-1])
    try:
        assert alive(child)
        assert not is_locked(folder)
        claim_folder(folder).release()
        assert alive(child)
    finally:
        os.kill(child, signal.SIGKILL)


def test_network_file_systems_and_failing_flock_give_a_note_not_a_hang(tmp_path, monkeypatch):
    folder = str(tmp_path / "my run")
    mounts = tmp_path / "mounts"
    escaped = str(tmp_path).replace(" ", "\\040") + "/my\\040run"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\nserver:/export {escaped} nfs4 rw 0 0\n")
    monkeypatch.setattr(folder_lock, "MOUNTS", str(mounts))
    assert folder_lock.filesystem_type(os.path.join(folder, "checkpoints")) == "nfs4"
    assert folder_lock.filesystem_type(str(tmp_path)) == "ext4"
    with claim_folder(folder) as lock:
        assert lock.held and len(lock.notes) == 1
        assert "nfs4" in lock.notes[0] and "another machine" in lock.notes[0]

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(folder_lock.fcntl, "flock", no_locks)
    with claim_folder(folder) as lock:
        assert not lock.held
        assert any("WITHOUT the lock" in n and os.strerror(errno.ENOLCK) in n for n in lock.notes)


def test_unwritable_folder_is_one_line_and_leaves_no_lock(tmp_path, monkeypatch):
    folder = str(tmp_path / "run")
    monkeypatch.setenv(TEST_READ_ONLY_ENV, folder)
    with pytest.raises(FolderNotWritable) as info:
        claim_folder(folder)
    assert str(info.value).startswith(f"the output folder {folder} cannot be written: "
                                      "Read-only file system")
    assert not is_locked(folder)
    vdl = os.path.join(folder, "vdl")
    monkeypatch.setenv(TEST_READ_ONLY_ENV, vdl)
    with pytest.raises(FolderNotWritable, match=f"^the VisualDL log folder {vdl} cannot be"):
        claim_folder(folder, [("the VisualDL log folder", vdl)])
    assert not is_locked(folder)


# ------------------------------------------------------- Trainer from Python
@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("synthetic")))


def test_trainer_holds_the_lock_until_train_or_close_and_repairs_latest(tmp_path, data_root):
    out = str(tmp_path / "run")
    cfg = config(data_root, out, Global={"max_steps": 4, "checkpoint": "auto"},
                 Checkpoint={"interval": 2, "keep_last": 3})
    first = Trainer(cfg)
    assert is_locked(out)
    with pytest.raises(FolderInUse, match=f"^{out} is in use by another job .*pid {os.getpid()}"):
        Trainer(cfg)
    assert is_locked(out)  # the refused one did not release the first one's lock
    first.train()
    assert not is_locked(out)
    root = os.path.join(out, "checkpoints")
    assert sorted(os.listdir(root)) == ["latest", "step_00000002", "step_00000004"]
    assert open(os.path.join(root, "latest")).read() == "step_00000004\n"

    # As a kill between the rename of step 4 and the rewrite of `latest` leaves them.
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step_00000002\n")
    second = Trainer(cfg)
    assert is_locked(out) and second.step == 4
    assert open(os.path.join(root, "latest")).read() == "step_00000004\n"
    lines = [line for line in open(os.path.join(out, "train.log")) if "checkpoints/latest" in line]
    assert len(lines) == 1 and lines[0].rstrip().endswith(
        f"{root}/latest named 'step_00000002'; it now names step_00000004, the newest complete "
        "checkpoint"), lines
    second.close()
    assert not is_locked(out)
    second.close()  # idempotent

    # `latest` missing, the newest checkpoint cut short: the newest complete one is named.
    os.remove(os.path.join(root, "latest"))
    head = os.path.join(root, "step_00000004", "head_rank0", "weight.npy")
    with open(head, "r+b") as f:
        f.truncate(os.path.getsize(head) // 2)
    third = Trainer(config(data_root, out, Global={"max_steps": 4}))  # checkpoint: null
    assert open(os.path.join(root, "latest")).read() == "step_00000002\n"
    assert is_locked(out)
    del third
    gc.collect()
    assert not is_locked(out)

    # A constructor that fails after taking the lock releases it.
    with pytest.raises(FileNotFoundError):
        Trainer(config(data_root, out, Global={"checkpoint": str(tmp_path / "nowhere")}))
    assert not is_locked(out)


def test_tools_that_write_into_a_run_folder_are_refused_while_it_is_in_use(tmp_path, data_root,
                                                                            capsys):
    out = str(tmp_path / "run")
    cfg = config(data_root, out, Global={"max_steps": 2}, Checkpoint={"interval": 2},
                 Loss={"sub_centers": 2})
    Trainer(cfg).train()
    step = os.path.join(out, "checkpoints", "step_00000002")
    yaml_path = tmp_path / "config.yaml"
    yaml_path.write_text(dump_config(cfg))
    reshard, checkpoint_tool, clean = (load_tool(n) for n in ("reshard", "checkpoint",
                                                              "clean_subcenters"))
    before = sorted(os.listdir(out)), sorted(os.listdir(os.path.join(out, "checkpoints")))
    holder = Holder(out)
    try:
        calls = {
            "reshard": lambda: reshard.main([step, "--world-size", "2", "--output",
                                             os.path.join(out, "checkpoints", "two")]),
            "import-arcface-torch": lambda: checkpoint_tool.main(
                ["import-arcface-torch", str(tmp_path / "arcface"), "-c", str(yaml_path)]),
            "clean_subcenters": lambda: clean.main(["-c", str(yaml_path), "--checkpoint", step]),
        }
        for name, call in calls.items():
            assert call() == IN_USE, name
            err = capsys.readouterr().err
            lines = error_lines(err)
            assert len(lines) == 1 and lines[0].startswith(f"error: {out} is in use by another job "
                                                           "(host elsewhere, pid 4242, started "
                                                           "2031-02-03T04:05:06+00:00"), (name, err)
        assert (sorted(os.listdir(out)), sorted(os.listdir(os.path.join(out, "checkpoints")))) == before
        # Outside the run's folder, re-sharding does not need its lock.
        assert reshard.main([step, "--world-size", "2", "--output", str(tmp_path / "two")]) == 0
    finally:
        holder.close()
    assert reshard.main([step, "--world-size", "2", "--output",
                         os.path.join(out, "checkpoints", "two")]) == 0
    assert not is_locked(out)
    verify_checkpoint(os.path.join(out, "checkpoints", "two"), "full")


# ------------------------------------------------------ jobs (subprocesses)
def test_second_job_is_refused_with_one_line_and_writes_nothing(tmp_path, faces):
    out = tmp_path / "out"
    holder = Holder(str(out))
    try:
        code, text = run([sys.executable, TRAIN, "-c", write_config(tmp_path, faces, out)],
                         str(tmp_path))
    finally:
        holder.close()
    assert code == IN_USE, text[-3000:]
    lines = error_lines(text)
    assert lines == [f"error: {out} is in use by another job (host elsewhere, pid 4242, started "
                     "2031-02-03T04:05:06+00:00: tools/train.py -c first.yaml); it holds "
                     f"{out}/.plsc.lock: wait for that job to end or choose another output "
                     "folder"], text[-3000:]
    assert "Traceback" not in text and not step_lines(text)
    assert os.listdir(out) == [".plsc.lock"]  # no train.log, no config.yaml, no checkpoints


def test_two_jobs_on_one_folder_the_second_stops_on_every_rank(tmp_path, faces, run_ranks):
    """A job is running (paused by SIGSTOP after its first step, so it surely runs); the same
    command on 2 launched ranks stops on both with one line each, 73; the first job, resumed,
    trains to its end and its checkpoints verify."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path, faces, out, max_steps=100, interval=50)
    first = subprocess.Popen([sys.executable, TRAIN, "-c", cfg], cwd=str(tmp_path), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reader = Reader(first)
    try:
        reader.wait_for("step 1/100")
        first.send_signal(signal.SIGSTOP)
        assert first.poll() is None, "the first job ended before it could be paused"
        done = run_ranks(TRAIN, 2, ["-c", cfg], cwd=str(tmp_path), timeout=LIMIT)
        assert done.status == IN_USE, done.tail()
        for rank in (0, 1):
            log = done.logs[rank]
            lines = error_lines(log)
            assert len(lines) == 1 and lines[0].startswith(
                f"error: {out} is in use by another job (host {socket.gethostname()}, pid "
                f"{first.pid}, started "), (rank, log[-2000:])
            assert not step_lines(log) and "Traceback" not in log
    finally:
        first.send_signal(signal.SIGCONT)
    try:
        assert first.wait(LIMIT) == 0, reader.text[-3000:]
    except subprocess.TimeoutExpired:
        first.kill()
        pytest.fail("the first job did not finish")
    reader.thread.join(10)
    assert [int(line.split("step ")[1].split("/")[0]) for line in step_lines(reader.text)] == \
        list(range(1, 101))
    checkpoint_tool = load_tool("checkpoint")
    root = out / "checkpoints"
    assert sorted(os.listdir(root)) == ["latest", "step_00000050", "step_00000100"]
    for name in ("step_00000050", "step_00000100"):
        assert checkpoint_tool.main(["verify", str(root / name)]) == 0
    assert not is_locked(str(out))


def test_killed_job_whose_loader_workers_live_on_does_not_block_the_next(tmp_path, faces):
    """Rank 0 is killed while its forked loader workers live on (stopped, so they cannot
    notice): they do not hold the lock, and the next job trains to its end."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path, faces, out, max_steps=100, num_workers=2)
    job = subprocess.Popen([sys.executable, TRAIN, "-c", cfg], cwd=str(tmp_path), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reader = Reader(job)
    reader.wait_for("step 1/100")
    job.send_signal(signal.SIGSTOP)
    workers = children(job.pid)
    try:
        assert len(workers) == 2, workers
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        job.kill()
        job.wait(LIMIT)
        assert all(alive(pid) for pid in workers)
        assert not is_locked(str(out))
        code, text = run([sys.executable, TRAIN, "-c", cfg, "-o", "Global.max_steps=3"],
                         str(tmp_path))
        assert code == 0 and not error_lines(text), text[-3000:]
        assert [line.split("step ")[1].split(" ")[0] for line in step_lines(text)] == \
            ["1/3", "2/3", "3/3"]
        assert all(alive(pid) for pid in workers)  # they lived on through the next job
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGKILL)


def _read_only_bind_mount_works(folder):
    probe = os.path.join(folder, "probe")
    try:
        proc = subprocess.run(["unshare", "-rm", "sh", "-c",
                               f"mount --bind '{folder}' '{folder}' && "
                               f"mount -o remount,bind,ro '{folder}' '{folder}' && "
                               f"! touch '{probe}' 2>/dev/null"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and not os.path.exists(probe)


def test_read_only_output_folder_stops_before_the_first_step(tmp_path, faces):
    out = tmp_path / "out"
    os.makedirs(out)
    if not _read_only_bind_mount_works(str(out)):
        pytest.skip("no read-only bind mount here (unshare -rm with mount --bind needs user and "
                    "mount namespaces); the writer's test hook covers the path instead")
    cfg = write_config(tmp_path, faces, out)
    code, text = run(["unshare", "-rm", "sh", "-c",
                      f"mount --bind '{out}' '{out}' && mount -o remount,bind,ro '{out}' '{out}' "
                      f"&& exec '{sys.executable}' '{TRAIN}' -c '{cfg}'"], str(tmp_path))
    assert code == IO_ERROR, text[-3000:]
    assert error_lines(text) == [f"error: the output folder {out} cannot be written: Read-only "
                                 f"file system ({out}/.plsc.lock)"], text[-3000:]
    assert "Traceback" not in text and not step_lines(text) and os.listdir(out) == []


def test_unwritable_visualdl_folder_stops_before_the_first_step(tmp_path, faces):
    out = tmp_path / "out"
    cfg = write_config(tmp_path, faces, out)
    vdl = out / "vdl"
    code, text = run([sys.executable, TRAIN, "-c", cfg, "-o", "Logging.visualdl=true"],
                     str(tmp_path), env=dict(os.environ, **{TEST_READ_ONLY_ENV: str(vdl)}))
    assert code == IO_ERROR, text[-3000:]
    lines = error_lines(text)
    assert len(lines) == 1 and lines[0].startswith(
        f"error: the VisualDL log folder {vdl} cannot be written: Read-only file system"), text
    assert "Traceback" not in text and not step_lines(text)
    assert not os.path.exists(out / "checkpoints") and not os.path.exists(out / "train.log")
    assert not is_locked(str(out))
    shutil.rmtree(out)
