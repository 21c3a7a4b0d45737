"""Every way a stop reaches a run (docs/faults.md, "Preemption"): SIGTERM or SIGINT to the top
process only, to every process group of the run, or to every process one by one (as Slurm's
scancel does), with 0 and 2 loader workers, on one process and on 2 launched ranks, after a
random step, during an evaluation and during a periodic save. Every rank ends with 75 and the
preemption line (never a data error), with a stop checkpoint (or the save in progress
completed), no process of the run left 5 s after it ended, nothing temporary left in the output
folder, and the same command then resumes to the uninterrupted run's final state bit for bit.
Then the grace period: a stop checkpoint that would not fit `Checkpoint.grace_seconds` is not
started."""
import glob
import os
import random
import re
import signal
import time

import numpy as np
import pytest
import yaml

import processes
from trainer_common import CLASSES, IMAGE, checked_closing_block, checkpoint_state, make_data

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "stop_worker.py")
PREEMPTED = 75
STEPS = 8
EVAL_STEP, SAVE_STEP = 4, 6  # Eval.interval 4, Checkpoint.interval 3: saves after 3, 6 and 8
QUIET_STEPS = (1, 2, 5, 7)  # neither evaluated nor saved after

# (ranks, signal, to whom, loader workers, when), one case a row
CASES = [(int(r), sig, how, int(w), when) for r, sig, how, w, when in map(str.split, """
1 TERM main  2 step
1 TERM group 2 step
1 INT  group 2 eval
1 TERM each  2 save
1 INT  main  0 save
1 TERM each  0 eval
1 INT  each  2 step
2 TERM main  2 step
2 TERM group 2 eval
2 INT  each  2 save
2 INT  main  0 step
2 TERM each  2 step
2 INT  group 0 save
""".strip().splitlines())]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("synthetic")))


def write_config(tmp, data_root, ranks, workers, **sections):
    """The run's config in `tmp`, output in `tmp`/out: the same global batch on 1 and 2 ranks."""
    raw = {
        "Global": {"seed": 0, "output_dir": str(tmp / "out"), "device": "cpu",
                   "max_steps": STEPS, "log_interval": 1, "checkpoint": "auto"},
        "Model": {"name": "IResNetTiny", "embedding_size": 32},
        "Loss": {"margin": "arcface", "scale": 16.0, "num_classes": CLASSES},
        "Data": {"dataset": "recordio", "root": data_root, "image_size": [IMAGE, IMAGE],
                 "batch_size": 4 // ranks, "num_workers": workers},
        "Optimizer": {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4},
        "LRScheduler": {"warmup_steps": 2},
        "Eval": {"root": data_root, "targets": ["val"], "interval": EVAL_STEP, "batch_size": 20},
        "Checkpoint": {"interval": 3, "keep_last": 10},
        "Logging": {"visualdl": False, "progress_bar": False},
    }
    for sec, values in sections.items():
        raw[sec].update(values)
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_root, run_ranks):
    """{ranks: final state} of runs that nothing stops."""
    states = {}
    for ranks in (1, 2):
        tmp = tmp_path_factory.mktemp(f"uninterrupted{ranks}")
        done = run_ranks(WORKER, ranks, ["-c", write_config(tmp, data_root, ranks, 2)],
                         cwd=str(tmp), timeout=240)
        assert done.status == 0, done.tail()
        states[ranks] = checkpoint_state(str(tmp / "out"), STEPS)
    return states


def alive(pids):
    return [pid for pid in pids if processes.alive(pid)]


@pytest.mark.parametrize("ranks,sig,how,workers,when", CASES,
                         ids=[f"{r}rank-{s}-{h}-{w}workers-{m}" for r, s, h, w, m in CASES])
def test_every_stop_ends_with_a_checkpoint_and_resumes_exactly(
        tmp_path, data_root, run_ranks, uninterrupted, ranks, sig, how, workers, when):
    step = {"step": random.choice(QUIET_STEPS), "eval": EVAL_STEP, "save": SAVE_STEP}[when]
    what = f"{when}:{step}"  # in every message: the step was drawn at random
    cfg = write_config(tmp_path, data_root, ranks, workers)
    pids = tmp_path / "pids"
    env = {"STOP_AT": what, "STOP_HOW": how, "STOP_SIGNAL": sig, "STOP_PIDS": str(pids),
           "STOP_SEED": str(random.randrange(1 << 30))}
    done = run_ranks(WORKER, ranks, ["-c", cfg], cwd=str(tmp_path), env=env, timeout=240)
    ended = time.time()
    assert [r and r["status"] for r in done.reports] == [PREEMPTED] * ranks, (what, done.tail())
    # The launcher passes a rank's 75 on, or ends with the number of a signal it received.
    assert done.status in (PREEMPTED, signal.Signals["SIG" + sig]), done.tail()
    for log in done.logs:
        assert re.search(rf"plsc: preempted: stopped at step {step} by signal", log), (what, log)
        assert "error:" not in log and "Traceback" not in log, (what, log)
    out = str(tmp_path / "out")
    assert os.path.isfile(os.path.join(out, "checkpoints", f"step_{step:08d}", "manifest.json"))
    left = [p for p in glob.glob(os.path.join(out, "**", "*"), recursive=True)
            if p.endswith((".tmp", ".part", ".old"))]
    assert not left, left
    run = [int(p) for p in pids.read_text().split()]
    while alive(run) and time.time() < ended + 5:
        time.sleep(0.1)
    assert not alive(run), (what, alive(run))
    again = run_ranks(WORKER, ranks, ["-c", cfg], cwd=str(tmp_path), timeout=240)
    assert again.status == 0, again.tail()
    assert f"resuming from {out}/checkpoints/step_{step:08d}" in again.logs[0], again.tail()
    got, expected = checkpoint_state(out, STEPS), uninterrupted[ranks]
    assert set(got) == set(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=f"{what}: {key}")


# ------------------------------------------------------------------ the grace period
LARGE = 300_000  # classes: a head of 2 x 38 MB (weight and momentum) on one process


@pytest.mark.parametrize("grace", [0.05, 600])
def test_a_stop_checkpoint_that_would_not_fit_the_grace_period_is_not_started(
        tmp_path, data_root, run_ranks, grace):
    """Checkpoint.grace_seconds below the measured save time: a warning at start and after the
    periodic save, and the stop after step 5 exits 75 within 5 s of the signal with one line
    naming step 3's checkpoint and the steps a resume repeats; a grace that fits saves."""
    cfg = write_config(tmp_path, data_root, 1, 2, Loss={"num_classes": LARGE},
                       Checkpoint={"interval": 3, "grace_seconds": grace})
    pids = tmp_path / "pids"
    env = {"STOP_AT": "step:5", "STOP_HOW": "group", "STOP_SIGNAL": "TERM",
           "STOP_PIDS": str(pids)}
    done = run_ranks(WORKER, 1, ["-c", cfg], cwd=str(tmp_path), env=env, timeout=240)
    out = str(tmp_path / "out")
    assert done.status == PREEMPTED, done.tail()
    lines = [line for line in done.logs[0].splitlines() if line.startswith("plsc: preempted")]
    assert len(lines) == 1, done.tail()
    checkpoints = sorted(os.listdir(os.path.join(out, "checkpoints")))
    if grace == 600:
        assert "checkpoint " + os.path.join(out, "checkpoints", "step_00000005") in lines[0]
        assert "step_00000005" in checkpoints and "grace" not in done.logs[0]
        checked_closing_block(out, 5, "stopped by signal 15 (SIGTERM)", checkpoint_step=5)
        return
    warnings = [line for line in done.logs[0].splitlines() if "a stop checkpoint would take" in line]
    assert len(warnings) == 1 and "Checkpoint.grace_seconds=0.05" in warnings[0], done.tail()
    assert "Checkpoint.interval" in warnings[0]
    assert "no stop checkpoint written" in lines[0], lines
    assert "past Checkpoint.grace_seconds=0.05" in lines[0], lines
    step3 = os.path.join(out, "checkpoints", "step_00000003")
    assert f"resumes from {step3} (step 3) and repeats steps 4-5" in lines[0], lines
    assert "step_00000005" not in checkpoints, checkpoints
    checked_closing_block(out, 5, "stopped by signal 15 (SIGTERM); no stop checkpoint",
                          checkpoint_step=3)
    assert done.ranks[0].ended - os.path.getmtime(pids) < 5, "not at once"
