"""One rank per Slurm task: `srun --ntasks N python tools/train.py ...` without Paddle's
launcher. Importing this module imports nothing outside the standard library.

In a task of a job step (`SLURM_STEP_NUM_TASKS` is set: `srun`, not the batch script itself)
where Paddle's launcher variables are absent, `adopt` sets the ones `paddle.distributed.
init_parallel_env` reads, from Slurm's:

| Paddle's variable | from Slurm |
|---|---|
| `PADDLE_TRAINER_ID` | `SLURM_PROCID` |
| `PADDLE_TRAINERS_NUM` | `SLURM_STEP_NUM_TASKS` |
| `PADDLE_LOCAL_SIZE` | this node's entry of `SLURM_STEP_TASKS_PER_NODE` (`2(x3),1`) |
| `PADDLE_MASTER` | the first host of `SLURM_STEP_NODELIST` : a port from the job id, step id and restart count (`MASTER_ADDR` / `MASTER_PORT` when set) |
| `PADDLE_CURRENT_ENDPOINT` | `SLURMD_NODENAME` : the master port + 1 + `SLURM_LOCALID` (Paddle only checks that it is set) |
| `FLAGS_selected_gpus` | with GPUs (`CUDA_VISIBLE_DEVICES` set): 0 when the task sees one GPU, else `SLURM_LOCALID` |

Under `paddle.distributed.launch` (one launcher per node, started by `srun --ntasks-per-node 1`)
the launcher's variables are there and nothing is changed.
"""
import os
import re

__all__ = ["in_step", "adopt", "first_host", "tasks_per_node", "master_port", "description"]

PORT_BASE, PORT_SPAN = 10000, 20000  # below Linux's ephemeral ports (32768-60999)


def in_step(environ=None):
    """Whether this process is a task of a Slurm job step started without Paddle's launcher."""
    environ = os.environ if environ is None else environ
    return "SLURM_STEP_NUM_TASKS" in environ and "PADDLE_TRAINER_ID" not in environ


def first_host(nodelist):
    """The first host of a Slurm host list: `node[07-09,12],gpu1` -> `node07`."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first item: up to a comma outside brackets
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", nodelist[:end])


def tasks_per_node(value):
    """`SLURM_STEP_TASKS_PER_NODE` (`2(x3),1`) as a list of counts per node: [2, 2, 2, 1]."""
    counts = []
    for item in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={value!r}: expected counts such as "
                             f"'2(x3),1'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def master_port(environ=None):
    """The rendezvous port every task of the step computes alike: `MASTER_PORT` when set, else
    one of 20000 ports above 10000 chosen by the job id, step id and restart count (a requeued
    job, or the next step, does not meet the previous one's socket)."""
    if environ.get("MASTER_PORT"):
        return int(environ["MASTER_PORT"])
    key = (int(environ.get("SLURM_JOB_ID", "0")) * 1009 + int(environ.get("SLURM_STEP_ID", "0"))
           * 31 + int(environ.get("SLURM_RESTART_COUNT", "0")))
    return PORT_BASE + key % PORT_SPAN


def adopt(environ=None):
    """Set Paddle's rank variables from Slurm's in a task of a step (see the module's table)
    in `environ` (os.environ); returns the variables set ({} outside a step or under Paddle's
    launcher, or when done before)."""
    environ = os.environ if environ is None else environ
    if not in_step(environ):
        return {}
    port = master_port(environ)
    host = environ.get("MASTER_ADDR") or first_host(environ["SLURM_STEP_NODELIST"])
    counts = tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE", "1"))
    node = int(environ.get("SLURM_NODEID", "0"))
    local = int(environ.get("SLURM_LOCALID", "0"))
    found = {
        "PADDLE_TRAINER_ID": environ["SLURM_PROCID"],
        "PADDLE_TRAINERS_NUM": environ["SLURM_STEP_NUM_TASKS"],
        "PADDLE_LOCAL_SIZE": str(counts[node] if node < len(counts) else max(counts)),
        "PADDLE_MASTER": f"{host}:{port}",
        "PADDLE_CURRENT_ENDPOINT": f"{environ.get('SLURMD_NODENAME', host)}:{port + 1 + local}",
    }
    gpus = environ.get("CUDA_VISIBLE_DEVICES")
    if gpus and "FLAGS_selected_gpus" not in environ:
        found["FLAGS_selected_gpus"] = "0" if len(gpus.split(",")) == 1 else str(local)
    environ.update(found)
    return found


def description(environ=None):
    """`Slurm job 12 (restart 1), step 0, nodes node[01-02]` for the run's log, or None outside
    a Slurm job."""
    environ = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in environ:
        return None
    restart = environ.get("SLURM_RESTART_COUNT")
    step = environ.get("SLURM_STEP_ID")
    return (f"Slurm job {environ['SLURM_JOB_ID']}" + (f" (restart {restart})" if restart else "")
            + (f", step {step}" if step is not None else ", batch script")
            + f", nodes {environ.get('SLURM_STEP_NODELIST') or environ.get('SLURM_JOB_NODELIST', '?')}")
