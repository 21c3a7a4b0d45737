"""A real one-machine Slurm cluster for the tests: munged, slurmctld and slurmd on this host,
their configuration, keys, state and logs in one temporary folder, stopped and removed by
`Cluster.stop` (also after a failure: `tests/test_slurm.py`'s session fixture).

    cluster = Cluster.start(folder)    # or raises Unavailable naming what is missing
    cluster.run(["srun", "-n2", "hostname"])     # with SLURM_CONF and MUNGE socket set
    cluster.stop()

Needs root (slurmd starts tasks as the submitting user, and munged's key must be private) and
Debian's `slurm-wlm` and `munge` packages (.ci/run installs them). The node claims 10 CPUs
(`SlurmdParameters=config_overrides`) so that several jobs (2 and 3 tasks) run side by side on a 2-core machine; two
partitions on the one node, `low` and `high` (a higher `PriorityTier`, `PreemptMode=REQUEUE`
with a grace time), express a scheduler's preemption without slurmdbd (QOS preemption needs
the accounting database).
"""
import os
import shutil
import signal
import socket
import subprocess
import time

from conftest import _free_ports

DAEMONS = ("munged", "slurmctld", "slurmd")
GRACE_SECONDS = 20  # the `low` partition's GraceTime (a preempted job's SIGTERM to SIGKILL)


class Unavailable(Exception):
    """The cluster cannot be started here (the message says why)."""


def missing():
    """What this machine lacks for the cluster ('' when nothing)."""
    if os.geteuid() != 0:
        return "root (slurmd runs a job's tasks as its user; munged's key must be private)"
    absent = [d for d in DAEMONS + ("srun", "sbatch", "scontrol") if shutil.which(d) is None]
    if absent:
        return ("the slurm-wlm and munge packages (missing: " + ", ".join(absent) +
                "; Debian: apt-get install slurm-wlm munge)")
    return ""


SLURM_CONF = """\
ClusterName=plsctest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire=5
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
SchedulerParameters=sched_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={host} NodeAddr=127.0.0.1 CPUs=10 RealMemory=2000 State=UNKNOWN
PartitionName=low Nodes={host} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={grace}
PartitionName=high Nodes={host} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


class Cluster:
    def __init__(self, folder):
        self.folder = folder
        self.conf = os.path.join(folder, "slurm.conf")
        self.munge_socket = os.path.join(folder, "munge", "munge.socket")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    @classmethod
    def start(cls, folder):
        why = missing()
        if why:
            raise Unavailable("needs " + why)
        cluster = cls(folder)
        try:
            cluster._start()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start(self):
        d = self.folder
        for sub in ("munge", "state", "spool"):
            os.makedirs(os.path.join(d, sub), mode=0o700, exist_ok=True)
        key = os.path.join(d, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self._daemon(["munged", "--force", "--key-file", key, "--socket", self.munge_socket,
                      "--pid-file", os.path.join(d, "munge", "munged.pid"),
                      "--log-file", os.path.join(d, "munge", "munged.log"),
                      "--seed-file", os.path.join(d, "munge", "munged.seed")],
                     os.path.join(d, "munge", "munged.pid"))
        ctld_port, slurmd_port = _free_ports(2)
        with open(self.conf, "w") as f:
            f.write(SLURM_CONF.format(host=socket.gethostname().split(".")[0], d=d,
                                      ctld_port=ctld_port, slurmd_port=slurmd_port,
                                      munge_socket=self.munge_socket, grace=GRACE_SECONDS))
        self._daemon(["slurmctld", "-i"], os.path.join(d, "slurmctld.pid"))  # -i: no old state
        self._daemon(["slurmd"], os.path.join(d, "slurmd.pid"))
        deadline = time.time() + 60
        while time.time() < deadline:
            state = self.run(["sinfo", "-h", "-o", "%t", "-p", "low"], check=False).stdout.strip()
            if state.startswith("idle"):
                return
            time.sleep(0.5)
        raise Unavailable(f"the node did not become idle (sinfo: {state!r})\n" + self.logs())

    def _daemon(self, cmd, pid_file):
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise Unavailable(f"{cmd[0]} did not start ({done.returncode}): "
                              f"{(done.stdout + done.stderr).strip()[-2000:]}\n" + self.logs())
        deadline = time.time() + 30
        while not os.path.isfile(pid_file) and time.time() < deadline:
            time.sleep(0.1)

    def run(self, cmd, check=True, **kw):
        """`cmd` with this cluster's SLURM_CONF; stdout and stderr as text."""
        done = subprocess.run(cmd, env=dict(self.env, **kw.pop("env", {})), capture_output=True,
                              text=True, timeout=kw.pop("timeout", 60), **kw)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: status {done.returncode}: "
                               f"{done.stdout}{done.stderr}")
        return done

    def logs(self):
        """The daemons' logs (last lines), for a failure message."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munge/munged.log"):
            path = os.path.join(self.folder, name)
            if os.path.isfile(path):
                with open(path, errors="replace") as f:
                    parts.append(f"--- {name}:\n" + "".join(f.readlines()[-30:]))
        return "\n".join(parts)

    def pids(self):
        found = {}
        for name, rel in (("slurmd", "slurmd.pid"), ("slurmctld", "slurmctld.pid"),
                          ("munged", "munge/munged.pid")):
            try:
                with open(os.path.join(self.folder, rel)) as f:
                    found[name] = int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        return found

    def stop(self):
        """Cancel every job and wait for them (up to 30 s), stop the daemons (SIGTERM, then
        SIGKILL after 20 s), kill whatever still runs with this cluster's SLURM_CONF (a step
        daemon, a task) and remove the folder. Returns what had to be killed (nothing)."""
        if os.path.isfile(self.conf):
            self.run(["scancel", "--full", "--user", "root"], check=False)
            deadline = time.time() + 30
            while time.time() < deadline and self.run(
                    ["squeue", "-h", "-o", "%i"], check=False).stdout.strip():
                time.sleep(0.5)
        killed = []
        pids = self.pids()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 20
        for name, pid in pids.items():
            while _alive(pid) and time.time() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                killed.append(name)
                os.kill(pid, signal.SIGKILL)
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)
        return killed

    def processes(self):
        """Processes other than this one whose environment names this cluster's slurm.conf."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0") and _alive(int(entry)):
                        found.append(int(entry))
            except OSError:
                pass
        return found


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
