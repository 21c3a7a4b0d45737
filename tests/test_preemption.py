"""Preemption and auto-resume: SIGTERM to one rank stops every rank after
the same step with a checkpoint and exit status 75; `Global.checkpoint: auto` resumes from it
and the run ends with the uninterrupted run's weights, bit for bit (every other way a stop
arrives: tests/test_stop_paths.py)."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import paddle
import pytest
import yaml

from trainer_common import (CLASSES, IMAGE, checked_closing_block, checkpoint_state, config,
                            make_data)
from plsc.train import Trainer
from plsc.checkpoint import find_checkpoint
from plsc.train.preemption import PREEMPTED_EXIT_CODE, Preempted, StopSignals

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "preempt_worker.py")
STEPS = 8


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("synthetic")))


# ------------------------------------------------------------------ one process
def test_stop_signals_are_recorded_then_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's burst: the same request
        time.sleep(0.2)
        assert stop.signum == signal.SIGTERM and stop.repeats == 1
        assert stop.agree() == (signal.SIGTERM, -1)  # a world of one: its own flags
        assert stop.agree(data_failed=True) == (signal.SIGTERM, 0)
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.set_wakeup_fd(-1) == -1  # the wake-up pipe was given back



def test_agreement_is_a_host_tensor_over_a_gloo_group(monkeypatch):
    """On GPUs (an NCCL world, faked here) the agreement's flag stays on the host and goes over
    a gloo group made once beside NCCL's, so it reads no device tensor; on the CPU (gloo) the
    world's group itself serves."""
    from plsc import distributed as pd
    from plsc.train import preemption
    made, reduced = [], []
    monkeypatch.setattr(preemption, "_HOST_GROUPS", {})
    monkeypatch.setattr(pd, "group_rank_size", lambda group=None: (1, 2))
    monkeypatch.setattr(paddle.distributed, "get_backend", lambda group=None: "NCCL")
    monkeypatch.setattr(pd, "gloo_group", lambda ranks=None: made.append("gloo") or "gloo-group")

    def all_reduce_(x, op, group=None):
        reduced.append((x.place.is_cpu_place(), op, group))
        x[1] = 3.0  # rank 2 of some other group failed to load its batch
        return x
    monkeypatch.setattr(pd, "all_reduce_", all_reduce_)
    stop = StopSignals()
    assert stop.agree() == (0, 2) and stop.agree(data_failed=True) == (0, 2)
    assert made == ["gloo"] and reduced == [(True, "max", "gloo-group")] * 2
    monkeypatch.setattr(paddle.distributed, "get_backend", lambda group=None: "GLOO")
    assert preemption.host_group() is None  # the CPU world's own group


_SECOND_SIGNAL = """
import os, signal, sys, threading, time
from plsc.train.preemption import StopSignals
first, second = (getattr(signal, 'SIG' + name) for name in sys.argv[1:3])
gap = float(sys.argv[3])
with StopSignals():
    def send():
        os.kill(os.getpid(), first)
        time.sleep(gap)
        os.kill(os.getpid(), second)
    threading.Thread(target=send).start()
    threading.Event().wait(float(sys.argv[4]))  # the main thread blocked, as in a collective
print("not ended")
"""


@pytest.mark.parametrize("first,second,gap", [("INT", "INT", 0.1), ("TERM", "TERM", 1.5),
                                              ("TERM", "INT", 1.5), ("INT", "TERM", 1.5)])
def test_second_signal_ends_the_process_at_once(first, second, gap):
    start = time.time()
    env = {k: v for k, v in os.environ.items() if k != "PADDLE_TRAINER_ID"}
    proc = subprocess.run([sys.executable, "-c", _SECOND_SIGNAL, first, second, str(gap), "60"],
                          capture_output=True, text=True, timeout=50, env=env)
    assert time.time() - start < 20
    signum = getattr(signal, "SIG" + second)
    assert proc.returncode == 128 + signum, proc.stdout + proc.stderr
    assert proc.stderr.count("plsc: second stop signal") == 1 and "not ended" not in proc.stdout


@pytest.mark.parametrize("first,second,gap,ends", [("TERM", "TERM", 2.5, False),
                                                   ("INT", "TERM", 2.5, False),
                                                   ("INT", "INT", 0.1, True)])
def test_in_a_launched_rank_a_later_sigterm_repeats_the_stop(first, second, gap, ends):
    """Paddle's launcher sends each rank its SIGTERMs one rank after the other (seconds apart
    on 8 ranks): in a launched rank a later SIGTERM is the same stop; Ctrl-C twice insists."""
    env = dict(os.environ, PADDLE_TRAINER_ID="3")
    proc = subprocess.run([sys.executable, "-c", _SECOND_SIGNAL, first, second, str(gap),
                           str(gap + 1.0)], capture_output=True, text=True, timeout=50, env=env)
    if ends:
        assert proc.returncode == 128 + getattr(signal, "SIG" + second), proc.stderr
    else:
        assert proc.returncode == 0 and "not ended" in proc.stdout, proc.stdout + proc.stderr
        assert "second stop signal" not in proc.stderr


@pytest.mark.parametrize("first,second", [("TERM", "INT"), ("INT", "TERM"), ("TERM", "TERM")])
def test_signals_of_one_stop_within_a_second_are_one_request(first, second):
    """A launcher forwards Ctrl-C's SIGINT as SIGTERM, a scheduler signals every process of a
    job too: two stop signals 0.1 s apart are one request (not SIGINT twice: see above)."""
    with StopSignals() as stop:
        os.kill(os.getpid(), getattr(signal, "SIG" + first))
        time.sleep(0.1)
        os.kill(os.getpid(), getattr(signal, "SIG" + second))
        time.sleep(0.2)
        assert stop.signum == getattr(signal, "SIG" + first) and stop.repeats == 1


def test_a_worker_death_is_part_of_a_stop_only_when_a_stop_signal_is_here():
    """`claims`: a worker's death belongs to a stop pending in this process, or to a stop
    signal that reaches this process within the wait (scancel may reach the worker first);
    SIGKILL alone, or SIGTERM with no stop here, stays a data error."""
    from plsc.data import DataError, WorkerDied
    term, kill = WorkerDied([(7, -signal.SIGTERM)]), WorkerDied([(7, -signal.SIGKILL)])
    with StopSignals() as stop:
        start = time.time()
        assert not stop.claims(kill, wait=5.0) and time.time() - start < 0.5  # no wait for 9
        assert not stop.claims(term, wait=0.3) and time.time() - start > 0.3
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert stop.claims(term, wait=5.0)
        assert stop.claims(kill) and not stop.claims(DataError("bad.jpg: cannot decode"))
        assert 0 < stop.seconds_since_signal() < 5


def test_auto_starts_fresh_then_resumes(tmp_path, data_root):
    out = str(tmp_path / "run")
    assert find_checkpoint("auto", out) is None
    with pytest.raises(FileNotFoundError, match="latest"):
        find_checkpoint("latest", out)
    first = Trainer(config(data_root, out, Global={"checkpoint": "auto", "max_steps": 3}))
    assert first.step == 0
    first.train()
    log = open(os.path.join(out, "train.log")).read()
    assert "Global.checkpoint=auto: no checkpoint under" in log
    second = Trainer(config(data_root, out, Global={"checkpoint": "auto", "max_steps": 5}))
    assert second.step == 3
    assert "Global.checkpoint=auto: resuming from" in open(os.path.join(out, "train.log")).read()
    np.testing.assert_array_equal(second.head.weight.numpy(), first.head.weight.numpy())


def test_signal_in_one_process_checkpoints_and_resume_is_exact(tmp_path, data_root):
    full = Trainer(config(data_root, str(tmp_path / "full"), Global={"max_steps": 6}))
    full.train()
    out = str(tmp_path / "stopped")
    stopped = Trainer(config(data_root, out, Global={"max_steps": 6, "checkpoint": "auto"}))
    real = stopped._after_step

    def after_step():
        real()
        if stopped.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
    stopped._after_step = after_step
    with pytest.raises(Preempted) as info:
        stopped.train()
    assert info.value.step == 2 and info.value.signum == signal.SIGTERM
    assert info.value.checkpoint.endswith("step_00000002") and os.path.isdir(info.value.checkpoint)
    assert checked_closing_block(out, 2, "stopped by signal 15 (SIGTERM)",
                                 checkpoint_step=2) == info.value.checkpoint
    resumed = Trainer(config(data_root, out, Global={"max_steps": 6, "checkpoint": "auto"}))
    assert resumed.step == 2
    resumed.train()
    for a, b in zip(full.backbone.parameters(), resumed.backbone.parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(full.head.weight.numpy(), resumed.head.weight.numpy())
    np.testing.assert_array_equal(full.head_opt.state_dict()["weight.velocity"].numpy(),
                                  resumed.head_opt.state_dict()["weight.velocity"].numpy())


# ------------------------------------------------------------- launched ranks
def write_config(path, data_root, output_dir, interval=100):
    raw = {
        "Global": {"seed": 0, "output_dir": output_dir, "device": "cpu", "max_steps": STEPS,
                   "log_interval": 1, "checkpoint": "auto"},
        "Model": {"name": "IResNetTiny", "embedding_size": 32},
        "Loss": {"margin": "arcface", "scale": 16.0, "num_classes": CLASSES,
                 "param_dtype": "bfloat16"},
        "Data": {"dataset": "recordio", "root": data_root, "image_size": [IMAGE, IMAGE],
                 "batch_size": 4, "num_workers": 0},
        "Optimizer": {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4},
        "LRScheduler": {"warmup_steps": 2},
        "Checkpoint": {"interval": interval, "keep_last": 5},
        "Logging": {"visualdl": False, "progress_bar": False},
    }
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return path


def launch(run_ranks, tmp, data_root, signal_rank=-1, signal_step=0, pause=0.0, interval=100,
           **kw):
    """2 ranks of tests/preempt_worker.py on a fresh `tmp`/config.yaml (output `tmp`/out,
    checkpoints every `interval` steps); `kw`: more `run_ranks` arguments (env, launch_args,
    wait)."""
    cfg = write_config(str(tmp / "config.yaml"), data_root, str(tmp / "out"), interval)
    return run_ranks(WORKER, 2, [signal_rank, signal_step, pause, "-c", cfg], cwd=str(tmp),
                     timeout=240, **kw)


def stop_steps(logs):
    """The step each rank reported stopping at, from the ranks' `logs`."""
    found = [re.findall(r"preempted: stopped at step (\d+) by signal 15", text) for text in logs]
    return [int(f[0]) if f else None for f in found]


def final_state(out):
    """Backbone and every head array of the final checkpoint, as stored."""
    return checkpoint_state(out, STEPS)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_root, run_ranks):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    done = launch(run_ranks, tmp, data_root)
    assert done.status == 0, done.tail()
    return final_state(str(tmp / "out"))


def assert_resumes_to(run_ranks, tmp, data_root, stopped_at, expected):
    ckpt = os.path.join(str(tmp / "out"), "checkpoints", f"step_{stopped_at:08d}")
    assert os.path.isfile(os.path.join(ckpt, "meta.json")), "no checkpoint at the stop"
    done = launch(run_ranks, tmp, data_root)  # the same command: Global.checkpoint=auto
    assert done.status == 0, done.tail()
    assert "Global.checkpoint=auto: resuming from" in done.logs[0]
    got = final_state(str(tmp / "out"))
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path, data_root, uninterrupted,
                                                         run_ranks):
    done = launch(run_ranks, tmp_path, data_root, signal_rank=1, signal_step=3)
    assert done.status == PREEMPTED_EXIT_CODE, done.tail()  # the launcher passes it on
    assert stop_steps(done.logs) == [3, 3], done.tail(2000)
    assert_resumes_to(run_ranks, tmp_path, data_root, 3, uninterrupted)


def test_peer_failures_are_recognised():
    from plsc.train.preemption import peer_failure
    reset = RuntimeError("[/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:576] Read error "
                         "[127.0.0.1]:30631: Connection reset by peer")
    assert peer_failure(reset, 0, 2) == (1, "Read error [127.0.0.1]:30631: Connection reset by peer")
    assert peer_failure(reset, 2, 4)[0] is None  # an address, not a rank
    timeout = RuntimeError("[gloo/transport/tcp/pair.cc:1] TIMEOUT self_rank = 0 pair_rank = 3")
    assert peer_failure(timeout, 0, 4)[0] == 3
    assert peer_failure(RuntimeError("DataLoader timed out"), 0, 2) is None
    assert peer_failure(RuntimeError("shapes do not match"), 0, 2) is None


def test_sigkill_of_one_rank_ends_the_other_with_one_line(tmp_path, data_root, run_ranks):
    """Rank 1 is killed (SIGKILL) after step 3; rank 0 exits within seconds with one line
    naming rank 1 and no traceback, and `latest` (the step-2 checkpoint) still loads."""
    start = time.time()
    done = launch(run_ranks, tmp_path, data_root, 1, 3, 0, interval=2,
                  env={"PREEMPT_SIGNAL": "KILL"})
    assert done.status != 0
    assert time.time() - start < 120
    log0 = done.logs[0]
    lines = [line for line in log0.splitlines() if line.startswith("plsc: rank 0:")]
    assert len(lines) == 1, log0[-3000:]
    assert "rank 1 stopped answering after step 3" in lines[0]
    assert "step_00000002" in lines[0]
    assert "Traceback" not in log0
    latest = find_checkpoint("latest", str(tmp_path / "out"))
    assert latest.endswith("step_00000002")
    from plsc.checkpoint import load_head_rows
    assert load_head_rows(latest, "weight", 0, CLASSES).shape[0] == CLASSES
