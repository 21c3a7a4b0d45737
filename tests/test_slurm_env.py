"""Slurm without a cluster: the rank variables a task of `srun` gets from Slurm's
(`plsc.distributed.slurm`), and the exit-status mapping of demo/slurm_train.sbatch against
docs/faults.md's table (its Slurm column), with stand-ins for srun and scontrol. The real
cluster: tests/test_slurm.py."""
import os
import re
import signal
import subprocess
import time

import pytest

from plsc import distributed as pd
from plsc.distributed import slurm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "demo", "slurm_train.sbatch")
PADDLE_KEYS = ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_LOCAL_SIZE", "PADDLE_MASTER",
               "PADDLE_CURRENT_ENDPOINT", "FLAGS_selected_gpus", "MASTER_ADDR", "MASTER_PORT")

# Task 4 of a 5-task step on three nodes (2, 2 and 1 tasks): the first task of the third node.
STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "4", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "2", "SLURM_STEP_NUM_TASKS": "5", "SLURM_NTASKS": "5",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_STEP_NODELIST": "gpu[07-08],cpu3",
        "SLURMD_NODENAME": "cpu3"}


def test_first_host_and_tasks_per_node():
    for nodelist, first in (("vm", "vm"), ("node[07-09,12],gpu1", "node07"),
                            ("gpu1,node[07-09]", "gpu1"), ("rack[2-3]-n[10-11]", "rack2-n10"),
                            ("a[5,1-2]", "a5")):
        assert slurm.first_host(nodelist) == first, nodelist
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.tasks_per_node("8") == [8]
    with pytest.raises(ValueError, match="SLURM_STEP_TASKS_PER_NODE"):
        slurm.tasks_per_node("2(3)")


def test_a_task_of_a_step_becomes_a_rank(monkeypatch):
    for key in PADDLE_KEYS:  # each restored to absent afterwards
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    for key, value in STEP.items():
        monkeypatch.setenv(key, value)
    assert pd.launched_rank() == 4 and pd.launched_world_size() == 5
    port = int(os.environ["PADDLE_MASTER"].split(":")[1])
    assert os.environ["PADDLE_MASTER"] == f"gpu07:{port}"
    assert os.environ["PADDLE_CURRENT_ENDPOINT"] == f"cpu3:{port + 1}"
    assert os.environ["PADDLE_LOCAL_SIZE"] == "1"
    assert "FLAGS_selected_gpus" not in os.environ


def test_port_gpus_and_what_is_left_alone():
    env = dict(STEP, SLURM_NODEID="1", SLURM_PROCID="3", SLURM_LOCALID="1")
    set_ = slurm.adopt(env)
    assert (set_["PADDLE_TRAINER_ID"], set_["PADDLE_LOCAL_SIZE"]) == ("3", "2")
    assert slurm.adopt(env) == {}  # done: Paddle's variables are there now
    ports = {slurm.master_port(dict(STEP, **change)) for change in
             ({}, {"SLURM_PROCID": "1"}, {"SLURM_NODEID": "0"})}
    assert len(ports) == 1 and 10000 <= ports.pop() < 30000  # every task agrees
    others = {slurm.master_port(dict(STEP, **change)) for change in
              ({}, {"SLURM_RESTART_COUNT": "1"}, {"SLURM_STEP_ID": "1"}, {"SLURM_JOB_ID": "4243"})}
    assert len(others) == 4  # a requeue, the next step, another job: another port
    given = slurm.adopt(dict(STEP, MASTER_ADDR="10.0.0.1", MASTER_PORT="29500",
                             CUDA_VISIBLE_DEVICES="0,1", SLURM_LOCALID="1"))
    assert given["PADDLE_MASTER"] == "10.0.0.1:29500" and given["FLAGS_selected_gpus"] == "1"
    assert slurm.adopt(dict(STEP, CUDA_VISIBLE_DEVICES="3"))["FLAGS_selected_gpus"] == "0"
    launched = dict(STEP, PADDLE_TRAINER_ID="1")  # under paddle.distributed.launch
    batch = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}  # the script itself
    for env in (launched, batch):
        before = dict(env)
        assert slurm.adopt(env) == {} and env == before
    assert slurm.description(dict(STEP, SLURM_RESTART_COUNT="2")) == \
        "Slurm job 4242 (restart 2), step 0, nodes gpu[07-08],cpu3"
    assert slurm.description(batch) == "Slurm job 4242, batch script, nodes ?"
    assert slurm.description({}) is None


def slurm_column():
    """docs/faults.md's first table: {status: its Slurm column} (`128 + n` as 128)."""
    with open(os.path.join(ROOT, "docs", "faults.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("| exit status | meaning |", 1)[1].split("\n\n", 1)[0]
    return {int(m.group(1)): m.group(2).strip() for m in
            re.finditer(r"^\| (\d+)\b.*\| ([^|]+) \|$", table, re.M)}


def run_script(tmp_path, status, signal_script=False):
    """demo/slurm_train.sbatch with an srun that ends with `status` (after a TERM when
    `signal_script`: the script is signalled and passes it on), an scontrol that notes a
    requeue and an scancel that fails. Returns (the script's status, whether it requeued)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        f"trap 'exit {status}' TERM\n"
        f"{'while :; do sleep 0.05; done' if signal_script else f'exit {status}'}\n")
    (bin_dir / "scontrol").write_text(
        f"#!/bin/bash\n[ \"$1\" = requeue ] && echo \"$2\" >> {tmp_path}/requeued\n"
        "[ \"$1 $2\" = \"show hostnames\" ] && echo node1\nexit 0\n")
    (bin_dir / "scancel").write_text("#!/bin/bash\nexit 1\n")  # the script then signals srun
    for name in ("srun", "scontrol", "scancel"):
        os.chmod(bin_dir / name, 0o755)
    marker = tmp_path / "requeued"
    if marker.exists():
        marker.unlink()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="7",
               SLURM_JOB_NODELIST="node1", SLURM_SUBMIT_DIR=str(tmp_path))
    proc = subprocess.Popen(["bash", SCRIPT, "config.yaml"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if signal_script:
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, marker.exists(), out


def test_the_script_requeues_what_the_faults_table_says(tmp_path):
    column = slurm_column()
    assert set(column) == {0, 2, 65, 69, 70, 73, 74, 75, 78, 128}
    cases = {status: column[status] for status in column if status != 128}
    cases.update({137: column[128], 143: column[128], 130: column[128], 15: column[128]})
    for status, says in cases.items():
        code, requeued, out = run_script(tmp_path, status)
        if says.startswith("requeued"):
            assert requeued and code == 0, (status, out)
        else:
            assert not requeued and code == status, (status, out)
    # 2 is the launcher's own status after SIGINT too: requeued when the script was signalled
    code, requeued, out = run_script(tmp_path, 2, signal_script=True)
    assert requeued and code == 0, out
    code, requeued, out = run_script(tmp_path, 65, signal_script=True)
    assert not requeued and code == 65, out
