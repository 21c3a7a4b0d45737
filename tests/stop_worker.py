"""tools/train.py with a stop sent the ways a cluster sends one (tests/test_stop_paths.py).

    python tests/stop_worker.py -c CONFIG [-o ...]

Environment: STOP_AT=step:N|eval:N|save:N starts the stop after optimizer step N, at the start
of the evaluation after step N, or in the middle of the periodic save of step N (its first head
array written); STOP_HOW=main|group|each sends signal STOP_SIGNAL (TERM or INT) to the run's
top process (the launcher, or the one process), to every process group of the run (the
launcher's and each rank's, which holds its loader workers), or to every process one by one in
an order drawn from STOP_SEED (as Slurm's scancel does). Rank STOP_RANK (default 0) starts it,
through a sender process outside the run, which writes the run's pids to STOP_PIDS, and then
waits for the signals to land (so they land inside the evaluation or the save). Each rank
reports (tests/rank_report.py) the status the tool returned.

    python tests/stop_worker.py --send HOW SIGNAL ROOT SEED PIDS_FILE

is the sender.
"""
import os
import random
import signal
import sys
import time


def _tree(root):
    """(pid, process group) of `root` and every process below it."""
    parent, group = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(name)], group[int(name)] = int(fields[1]), int(fields[2])
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += [p for p, pp in parent.items() if pp == pid]
    return [(pid, group.get(pid)) for pid in found]


def send(how, signame, root, seed, pids_file):
    signum = getattr(signal, "SIG" + signame)
    tree = [(pid, group) for pid, group in _tree(root) if pid != os.getpid()]  # not the sender
    with open(pids_file, "w") as f:
        f.write(" ".join(str(pid) for pid, _ in tree))
    if how == "main":
        os.kill(root, signum)
    elif how == "group":
        for group in sorted({g for _, g in tree if g is not None}):
            os.killpg(group, signum)
    else:
        pids = [pid for pid, _ in tree]
        random.Random(seed).shuffle(pids)
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
            time.sleep(0.02)


if len(sys.argv) > 1 and sys.argv[1] == "--send":
    send(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    sys.exit(0)

import subprocess  # noqa: E402

import rank_report  # noqa: E402
import scripts  # noqa: E402
from plsc.process import ending, startup  # noqa: E402

startup.hold()  # as tools/train.py does, before Paddle is imported

from plsc.checkpoint import manager  # noqa: E402
from plsc.embedding import VerificationEvaluator  # noqa: E402
from plsc.train.trainer import Trainer  # noqa: E402

rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
launched = int(os.environ.get("PADDLE_TRAINERS_NUM", "1")) > 1
moment, _, at_step = os.environ.get("STOP_AT", "none:0").partition(":")
at_step = int(at_step)
state = {"trainer": None, "sent": False}


def trigger():
    """Send the stop once (from rank STOP_RANK) and wait until it has landed."""
    if state["sent"] or rank != int(os.environ.get("STOP_RANK", "0")):
        return
    state["sent"] = True
    root = os.getppid() if launched else os.getpid()
    subprocess.run([sys.executable, __file__, "--send", os.environ["STOP_HOW"],
                    os.environ["STOP_SIGNAL"], str(root), os.environ.get("STOP_SEED", "0"),
                    os.environ["STOP_PIDS"]], start_new_session=True, check=True)
    time.sleep(1.5)  # the signals (and the launcher's forwarded ones) land meanwhile


real_after_step = Trainer._after_step


def after_step(self):
    state["trainer"] = self
    if moment == "step" and self.step == at_step:
        trigger()
    real_after_step(self)


Trainer._after_step = after_step
real_evaluate = VerificationEvaluator.__call__


def evaluate(self, *args, **kwargs):
    if moment == "eval" and state["trainer"] is not None and state["trainer"].step == at_step:
        trigger()
    return real_evaluate(self, *args, **kwargs)


VerificationEvaluator.__call__ = evaluate
real_write_rows = manager.write_rows_npy


def write_rows(path, array):
    written = real_write_rows(path, array)
    if moment == "save" and f"step_{at_step:08d}" in path:
        trigger()
    return written


manager.write_rows_npy = write_rows
code = scripts.load("tools/train.py").main(sys.argv[1:])
rank_report.write({"status": code})
ending.end(code)
