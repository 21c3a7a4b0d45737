"""plsc on a real Slurm cluster: munged, slurmctld and slurmd started on this machine
(tests/slurm_cluster.py), jobs submitted with demo/slurm_train.sbatch in both launch styles,
stopped the ways a cluster stops them, requeued by the script and resumed by
`Global.checkpoint: auto`. The reference is the same 2-rank run under
`paddle.distributed.launch`, started beside the jobs.

The jobs run side by side (one module fixture, `runs`), each a case:
- `preempted`: launcher style (`srun --ntasks-per-node 1` + paddle.distributed.launch),
  preempted by a job of a higher-tier partition (PreemptMode=REQUEUE with a GraceTime: what a
  QOS preemption does, without the accounting database QOS needs);
- `term`: one rank per task (`srun --ntasks 2`), `scancel --batch --signal=TERM` during
  training (to the batch script only, as `--signal=B:TERM@30` does before the time limit: the
  script passes it on);
- `reshard`: the same but `scancel --signal=TERM` (to the tasks), then requeued with 3 tasks
  (`scontrol update NumTasks=3`);
- `killed`: one rank per task, SIGKILL to task 1 (its pid from `scontrol listpids`, what the
  out-of-memory killer does; scancel signals a whole step, not one task).
Each ends COMPLETED with status 0 after one requeue; `preempted`, `term` and `killed` with the
reference's losses and final weights bit for bit.

Needs root and Debian's slurm-wlm and munge; skipped elsewhere with the reason, except with
PLSC_REQUIRE_SLURM=1 (set by .ci/run), where it fails. The daemons are stopped and their
folder removed at the end of the session, also after a failure (the fixture's teardown checks
that no process of the cluster is left)."""
import os
import re
import signal
import sys
import tempfile
import time

import numpy as np
import pytest

import slurm_cluster
from conftest import worker_env
from test_preemption import STEPS, WORKER, final_state, launch, write_config
from trainer_common import CLASSES, make_data
from plsc.distributed import slurm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "demo", "slurm_train.sbatch")
PAUSE = 0.7  # seconds after each step: the signals land while the job trains
TIMEOUT = 240

MISSING = slurm_cluster.missing()
REQUIRED = os.environ.get("PLSC_REQUIRE_SLURM") == "1"  # set by .ci/run
pytestmark = pytest.mark.skipif(bool(MISSING) and not REQUIRED, reason="needs " + MISSING)


@pytest.fixture(scope="session")
def cluster():
    if MISSING:  # only reached with PLSC_REQUIRE_SLURM=1
        pytest.fail(f"PLSC_REQUIRE_SLURM=1 but this machine lacks {MISSING}")
    folder = tempfile.mkdtemp(prefix="plsc_slurm_")
    try:
        started = slurm_cluster.Cluster.start(folder)  # removes the folder when it fails
    except slurm_cluster.Unavailable as err:
        (pytest.fail if REQUIRED else pytest.skip)(f"the Slurm cluster did not start: {err}")
    yield started
    killed = started.stop()
    left = started.processes()
    assert not killed and not left and not os.path.exists(folder), (
        f"after the cluster's stop: killed {killed}, still running {left}, folder "
        f"{'kept' if os.path.exists(folder) else 'removed'}")


class Job:
    """demo/slurm_train.sbatch on `ntasks` tasks, training tests/preempt_worker.py's run (a
    pause after each step) in `folder`/out."""

    def __init__(self, cluster, folder, data_root, style, ntasks=2, interval=100):
        self.cluster, self.folder = cluster, folder
        folder.mkdir()
        self.out = str(folder / "out")
        cfg = write_config(str(folder / "config.yaml"), data_root, self.out, interval)
        env = worker_env({"PLSC_LAUNCH": style, "PLSC_PYTHON": sys.executable,
                          "PLSC_TRAIN": f"{WORKER} -1 0 {PAUSE}", "PYTHONUNBUFFERED": "1"})
        if style == "launcher":
            env["PLSC_PROCS_PER_NODE"] = str(ntasks)
        self.id = cluster.run(["sbatch", "--parsable", "-n", str(ntasks), "-o",
                               str(folder / "job.out"), SCRIPT, cfg], cwd=str(folder),
                              env=env).stdout.strip()
        self.events = {}

    def text(self, name="job.out"):
        path = os.path.join(self.out, "train.log") if name == "train.log" else self.folder / name
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def reached(self, step):
        return re.search(rf"step {step}/{STEPS} ", self.text("train.log")) is not None

    def state(self):
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...)."""
        text = self.cluster.run(["scontrol", "show", "job", self.id], check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def task_pid(self, task):
        text = self.cluster.run(["scontrol", "listpids", f"{self.id}.0"], check=False).stdout
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 5 and fields[4] == str(task):
                return int(fields[0])
        return None

    def why(self):
        return (f"job {self.id} in {self.folder}: {self.state()}\n--- job.out:\n"
                f"{self.text()[-4000:]}\n--- train.log:\n{self.text('train.log')[-3000:]}")


def losses(log):
    """{step: the loss string train.log printed for it} (a resumed run's log goes on)."""
    found = {}
    for step, loss in re.findall(rf"step (\d+)/{STEPS} epoch \d+ loss (\S+)", log):
        assert found.setdefault(int(step), loss) == loss, f"step {step} logged twice, differently"
    return found


def drive(jobs, actions, until, timeout=TIMEOUT, watch=None):
    """Poll every 0.2 s: each pending action (name, condition, act) runs once its condition
    holds, `watch()` is called; returns when `until()` holds (all actions done), fails after
    `timeout`."""
    deadline = time.time() + timeout
    pending = list(actions)
    while time.time() < deadline:
        if watch is not None:
            watch()
        for action in list(pending):
            name, condition, act = action
            if condition():
                act()
                pending.remove(action)
        if not pending and until():
            return
        time.sleep(0.2)
    pytest.fail(f"still waiting for {[a[0] for a in pending]} after {timeout} s\n" +
                "\n".join(job.why() for job in jobs))


def done(job):
    return job.state().get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory, run_ranks):
    tmp = tmp_path_factory.mktemp("slurm")
    data_root = make_data(str(tmp / "data"))
    (tmp / "launcher").mkdir()
    reference = launch(run_ranks, tmp / "launcher", data_root, wait=False)

    # 1. alone in the partition a higher tier preempts (the preemptor takes every CPU)
    pre = Job(cluster, tmp / "preempted", data_root, "launcher")
    high = {}

    def preempt():
        high["id"] = cluster.run(["sbatch", "--parsable", "-p", "high", "-n", "10", "-o",
                                  str(tmp / "high.out"), "--wrap", "sleep 1"]).stdout.strip()
    drive([pre], [("preemption", lambda: pre.reached(3), preempt)],
          lambda: pre.state().get("Restarts") == "1" and cluster.run(
              ["squeue", "-h", "-j", high["id"]], check=False).stdout.strip() == "")

    # 2. side by side, in the partition nothing preempts any more
    term = Job(cluster, tmp / "term", data_root, "tasks")
    reshard = Job(cluster, tmp / "reshard", data_root, "tasks")
    killed = Job(cluster, tmp / "killed", data_root, "tasks", interval=2)

    def kill_task_1():
        pid = killed.task_pid(1)
        assert pid, killed.why()
        os.kill(pid, signal.SIGKILL)
        killed.events["killed"] = time.time()

    def three_tasks():
        cluster.run(["scontrol", "update", f"JobId={reshard.id}", "NumTasks=3", "NumCPUs=3"])

    def rank_lost_line():
        if "killed" in killed.events and "stopped answering" in killed.text():
            killed.events.setdefault("line", time.time())
    jobs = [pre, term, reshard, killed]
    drive(jobs, [
        ("scancel term", lambda: term.reached(3),  # the time limit's B:TERM: the script only
         lambda: cluster.run(["scancel", "--batch", "--signal=TERM", term.id])),
        ("scancel reshard", lambda: reshard.reached(3),
         lambda: cluster.run(["scancel", "--signal=TERM", reshard.id])),
        ("3 tasks", lambda: reshard.state().get("Restarts") == "1" and
         reshard.state().get("JobState") == "PENDING", three_tasks),
        ("kill task 1", lambda: killed.reached(3), kill_task_1),
    ], lambda: all(done(job) for job in jobs), watch=rank_lost_line)
    finished = reference.wait()
    assert finished.status == 0, finished.tail()
    return {"reference": str(tmp / "launcher" / "out"), "preempted": pre, "term": term,
            "reshard": reshard, "killed": killed}


def assert_completed_after_one_requeue(job):
    state = job.state()
    assert (state.get("JobState"), state.get("ExitCode"), state.get("Restarts")) == \
        ("COMPLETED", "0:0", "1"), job.why()
    log = job.text("train.log")
    assert len(re.findall(rf"plsc: Slurm job {job.id}, step 0, nodes ", log)) == 1, job.why()
    assert len(re.findall(rf"plsc: Slurm job {job.id} \(restart 1\), step 0, nodes ", log)) == 1
    assert "Global.checkpoint=auto: resuming from" in log, job.why()


def assert_as_the_reference(job, reference):
    expected = final_state(reference)
    assert losses(job.text("train.log")) == losses(open(os.path.join(reference, "train.log")).read())
    got = final_state(job.out)
    assert set(got) == set(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


@pytest.mark.parametrize("case,stopped_by", [("term", "signal 15"), ("preempted", "signal 15")])
def test_a_stop_checkpoints_requeues_and_resumes_exactly(runs, case, stopped_by):
    """TERM to the batch script (one rank per task) and a partition's preemption (the launcher
    per node): every rank stops after one step with a checkpoint and 75, the script requeues,
    the requeued job resumes from that checkpoint and ends with the uninterrupted run's losses
    and weights."""
    job = runs[case]
    assert_completed_after_one_requeue(job)
    log = job.text("train.log")
    stop = re.search(rf"preempted: stopped at step (\d+) by {stopped_by}", log)
    assert stop, job.why()
    assert f"step_{int(stop.group(1)):08d} at step {stop.group(1)}" in log, job.why()
    assert re.search(r"plsc-slurm: status \d+: requeued", job.text()), job.why()
    assert_as_the_reference(job, runs["reference"])


def test_a_requeue_with_three_tasks_reshards_the_head(runs):
    job = runs["reshard"]
    assert_completed_after_one_requeue(job)
    log = job.text("train.log")
    assert re.search(r"resumed from \S+ at step \d+ \(written by 2 rank\(s\), now 3\)", log), job.why()
    assert "plsc: 3 rank(s) on cpu" in log
    shards = [name for name in final_state(job.out) if name.endswith("weight.npy")]
    assert sorted(os.path.dirname(name) for name in shards) == [f"head_rank{r}" for r in range(3)]
    rows = sum(np.load(os.path.join(job.out, "checkpoints", f"step_{STEPS:08d}", name)).shape[0]
               for name in shards)
    assert rows == CLASSES


def test_a_killed_task_ends_the_others_with_the_rank_lost_status(runs):
    """SIGKILL to task 1: task 0 logs plsc's rank-lost line and ends with 69 within seconds
    (no hang), srun reports the kill (137), the script requeues, and the requeued job resumes
    from the last periodic checkpoint to the uninterrupted run's weights."""
    job = runs["killed"]
    out = job.text()  # the tasks' stderr
    lost = re.findall(r"^plsc: rank 0: rank 1 stopped answering after step \d+ .*; exiting", out,
                      re.M)
    assert len(lost) == 1 and "Traceback" not in out, job.why()
    assert job.events["line"] - job.events["killed"] < 30
    assert "task 0: Exited with exit code 69" in out and "plsc-slurm: status 137: requeued" in out
    assert_completed_after_one_requeue(job)
    assert_as_the_reference(job, runs["reference"])


def test_the_first_host_is_scontrols(cluster):
    for nodelist in ("vm", "node[07-09,12],gpu1", "rack[2-3]-n[10-11]", "a[5,1-2]"):
        hosts = cluster.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()
        assert slurm.first_host(nodelist) == hosts[0], nodelist
