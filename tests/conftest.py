"""The suite's shared fixtures: `run_ranks`, the one way to run a script on N ranks, and
`kernels`, the head's two kernel sets.

    finished = run_ranks(script, 2, [args...], cwd=str(tmp_path))
    assert finished.status == 0, finished.tail()
    finished.logs[1]      # rank 1's output (the launcher's workerlog.1)
    finished.reports[0]   # what rank 0 wrote with tests/rank_report.py (None: nothing)

The ranks run under `paddle.distributed.launch --nproc_per_node N` (extra launcher options in
`launch_args`: a master, several nodes, elastic restarts); one rank without `launch_args` runs
as one plain process (a single-process reference). `launcher=False` starts the N ranks as
processes of their own with the environment the launcher would give them, so that each rank's
own status and streams can be read (`finished.ranks`). `wait=False` returns the started group
(to signal it, or to start another group beside it); its `wait()` gives the same result.

Every process started here gets a PYTHONPATH that leads with this tree and tests/ (the
workers' helper modules), and is killed with its process group (SIGKILL) after `timeout`
seconds: a hang fails the test instead of stalling the suite.
"""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import pytest

import rank_report

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def worker_env(env=None):
    """This process's environment plus `env`, with PYTHONPATH leading with ROOT and tests/."""
    merged = dict(os.environ, **(env or {}))
    merged["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, TESTS, merged.get("PYTHONPATH")) if p)
    return merged


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _launcher_env(nranks):
    """Per rank, the variables Paddle's launcher sets for a group of `nranks` on this node."""
    ports = _free_ports(nranks + 1)
    endpoints = [f"127.0.0.1:{p}" for p in ports[1:]]
    return [{"PADDLE_TRAINER_ID": str(r), "PADDLE_TRAINERS_NUM": str(nranks),
             "PADDLE_LOCAL_SIZE": str(nranks), "PADDLE_MASTER": f"127.0.0.1:{ports[0]}",
             "PADDLE_NNODES": "1", "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
             "PADDLE_CURRENT_ENDPOINT": endpoints[r]} for r in range(nranks)]


@dataclass
class RankEnd:
    """How one process of a group ended, the launcher or a rank started without one
    (`ended`: time.time() then, or a little later)."""
    status: int
    out: str
    err: str
    ended: float


@dataclass
class Finished:
    """A group's end. `status`, `output`: the launcher's exit status and stdout + stderr (no
    launcher: rank 0's). `logs[r]`: rank r's output. `reports[r]`: rank r's report or None.
    `ranks[r]`: rank r's end, apart (no launcher only)."""
    status: int
    output: str
    logs: list
    reports: list
    ranks: list = field(default_factory=list)

    def tail(self, n=3000):
        """The last `n` characters of the output and of every rank's log, for a message."""
        return "\n".join([self.output[-n:]] + [f"--- rank {r}:\n{text[-n:]}"
                                               for r, text in enumerate(self.logs)])


class RankGroup:
    """A started group: `procs` are the launcher (one) or the ranks (`launcher=False`)."""

    def __init__(self, procs, nranks, log_dir, report_dir, timeout, what):
        self.procs, self.nranks, self.log_dir = procs, nranks, log_dir
        self.report_dir, self.timeout, self.what = report_dir, timeout, what

    def send_signal(self, signum, rank=None):
        """Signal the launcher (or, with `launcher=False`, every rank or rank `rank`)."""
        for r, proc in enumerate(self.procs):
            if rank is None or r == rank:
                proc.send_signal(signum)

    def log(self, rank):
        """Rank `rank`'s log so far ('' before it has one; launched groups only)."""
        path = self.log_dir and os.path.join(self.log_dir, f"workerlog.{rank}")
        if not path or not os.path.isfile(path):
            return ""
        with open(path, errors="replace") as f:
            return f.read()

    def wait(self):
        """The group's `Finished` once every process has ended (a hang: killed, and the test
        fails)."""
        ends = []
        for proc in self.procs:
            try:
                out, err = proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                for p in self.procs:
                    _kill_group(p)
                out, err = proc.communicate()
                pytest.fail(f"{self.what}: still running after {self.timeout} s (hang?)\n"
                            f"{(out or '')[-2000:]}{(err or '')[-2000:]}")
            ends.append(RankEnd(proc.returncode, out or "", err or "", time.time()))
        reports = rank_report.read(self.report_dir, self.nranks)
        if self.log_dir is None:  # plain processes: their own streams
            logs = [e.out + e.err for e in ends]
            return Finished(ends[0].status, logs[0], logs, reports, ends)
        logs = [self.log(r) for r in range(max(self.nranks, len(reports)))]
        return Finished(ends[0].status, ends[0].out, logs, reports)


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_ranks(script, nranks, args=(), *, cwd, env=None, launch_args=(), launcher=None,
              timeout=300, wait=True):
    """Run `script` (a Python file) on `nranks` ranks in folder `cwd` with `args`;
    `env`: variables added to this process's environment. A `Finished`, or with
    `wait=False` the `RankGroup`. See this module's docstring."""
    if launcher is None:
        launcher = nranks > 1 or bool(launch_args)
    report_dir = tempfile.mkdtemp(prefix="reports_", dir=cwd)
    base = worker_env(dict(env or {}, **{rank_report.ENV: report_dir}))
    what = f"{os.path.basename(script)} on {nranks} rank{'s' * (nranks > 1)}"
    start = dict(cwd=cwd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    cmd = [sys.executable, script, *map(str, args)]
    if launcher:
        log_dir = tempfile.mkdtemp(prefix="logs_", dir=cwd)
        cmd[1:1] = ["-m", "paddle.distributed.launch", "--nproc_per_node", str(nranks),
                    "--log_dir", log_dir, *map(str, launch_args)]
        procs = [subprocess.Popen(cmd, env=base, stderr=subprocess.STDOUT, **start)]
    else:
        log_dir = None
        per_rank = _launcher_env(nranks) if nranks > 1 else [{}]
        procs = [subprocess.Popen(cmd, env=dict(base, **rank_env), stderr=subprocess.PIPE,
                                  **start) for rank_env in per_rank]
    group = RankGroup(procs, nranks, log_dir, report_dir, timeout, what)
    return group.wait() if wait else group


@pytest.fixture(scope="session", name="run_ranks")
def run_ranks_fixture():
    """`run_ranks(script, nranks, args, cwd=..., env=..., timeout=...)`: see conftest.py."""
    return run_ranks


@pytest.fixture(params=("cpu", "device"))
def kernels(request, monkeypatch):
    """The kernel set the test runs on: "cpu" (numpy kernels on CPU tensors) or "device"
    (`PLSC_KERNELS=device`: Paddle ops only, what a GPU runs; `plsc.kernels.cpu_kernels.cpu_set`).
    `pytestmark = pytest.mark.usefixtures("kernels")` runs every test of a module on both."""
    from plsc.kernels.cpu_kernels import KERNELS_ENV
    monkeypatch.setenv(KERNELS_ENV, "device" if request.param == "device" else "auto")
    return request.param
