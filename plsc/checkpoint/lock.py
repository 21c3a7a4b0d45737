"""One job per output folder, and an output folder that can be written, checked at start.

`claim_folder` is called by every rank of a job before anything touches the folder. Rank 0
creates the folder, takes an exclusive, non-blocking `fcntl.flock` on `<folder>/.plsc.lock`
(it never waits), writes who holds it into that file (host, pid, start time, command) and
writes a probe file through `plsc.fileio` into the folder and into each extra folder named
(the VisualDL log folder). The ranks then agree on the outcome (one small exchange), so every
rank stops before its first step with the same one line: `FolderInUse` (exit status 73,
`IN_USE_EXIT_CODE`) or `FolderNotWritable` (74, `IO_ERROR_EXIT_CODE`).

The kernel releases the lock when the process ends, however it ends: a crash leaves no stale
lock on a local file system. A flock belongs to the open file description, which a forked
child shares: the descriptor is opened close-on-exec and closed (never unlocked: that would
unlock the parent) in every child forked after it was taken (`os.register_at_fork`), so a
loader worker that outlives its killed parent does not keep the folder locked. The lock file
is never deleted (a deleted and recreated file could be locked twice) and its holder line is
written in place (`fileio.write_in_place`: a rename would leave the lock on the old file).

Network file systems: flock may act on one machine only (NFS mounted with `local_lock`, Lustre
with `localflock`, many FUSE file systems) or not at all. On a file system whose type
(/proc/self/mounts) is one of those, a note says the lock may not keep out a job on another
machine; a flock that fails with any error other than "held" (ENOLCK, EOPNOTSUPP, ...) gives
a note and the job goes on without the lock. The notes are for the caller to log.
"""
import datetime
import fcntl
import json
import os
import re
import socket
import sys
import weakref

from .. import distributed as pd
from ..process.exits import IN_USE_EXIT_CODE, IO_ERROR_EXIT_CODE
from ..fileio import atomic_write, process_running, write_in_place
from .layout import LOCK_FILE
from .manager import _exchange

__all__ = ["FolderLock", "FolderInUse", "FolderNotWritable", "IN_USE_EXIT_CODE", "claim_folder",
           "lock_folder", "probe_writable", "filesystem_type", "run_folder_of"]

PROBE_FILE = ".plsc.probe"
MOUNTS = "/proc/self/mounts"
# file systems where a flock may not reach other machines (besides fuse.*)
NETWORK_FILE_SYSTEMS = frozenset({
    "nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "gpfs", "beegfs",
    "afs", "9p", "orangefs", "pvfs2", "ocfs2", "gfs2", "panfs", "fuse"})


class FolderInUse(Exception):
    """Another job holds the folder's lock; the message names the folder and the holder."""
    exit_code = IN_USE_EXIT_CODE


class FolderNotWritable(Exception):
    """The output folder (or the VisualDL log folder) cannot be written: one line."""
    exit_code = IO_ERROR_EXIT_CODE


class _Handle:
    """The lock's descriptor, shared by the lock object, its finaliser and the fork hook."""

    def __init__(self, fd):
        self.fd, self.pid = fd, os.getpid()


_HELD = {}  # id(handle) -> handle of every lock held by this process


def _close_in_child():
    """After a fork, in the child: close (not unlock) every inherited lock descriptor."""
    for handle in list(_HELD.values()):
        fd, handle.fd = handle.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def _release(handle):
    fd, handle.fd = handle.fd, None
    _HELD.pop(id(handle), None)
    if fd is None or handle.pid != os.getpid():  # a forked copy never unlocks its parent's lock
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass
    os.close(fd)


class FolderLock:
    """The lock of `folder` held by this process (`held`), or a stand-in that holds nothing
    (other ranks; a file system where flock failed). `notes`: warnings for the log.
    `release()` (idempotent) or the end of the object, or of the process, releases it."""

    def __init__(self, folder, fd=None, notes=()):
        self.folder, self.path = folder, os.path.join(folder, LOCK_FILE)
        self.notes = list(notes)
        self._handle = _Handle(fd)
        if fd is not None:
            _HELD[id(self._handle)] = self._handle
        self._finalizer = weakref.finalize(self, _release, self._handle)

    @property
    def held(self):
        return self._handle.fd is not None

    def release(self):
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


def _unescape(field):
    """A /proc/mounts field with its octal escapes (\\040 for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path):
    """The type of the file system holding `path` (e.g. ext4, nfs4, lustre), from the mount
    table; None where there is none to read."""
    real = os.path.realpath(path)
    try:
        with open(MOUNTS, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best, kind = -1, None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape(fields[1])
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= best:
            best, kind = len(point), fields[2]  # the last mount on a point is the visible one
    return kind


def _is_network(kind):
    return kind is not None and kind.split(".")[0] in NETWORK_FILE_SYSTEMS  # fuse.sshfs, not fuseblk


def _holder():
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": now,
            "command": " ".join(sys.argv)[:300]}


def _describe_holder(fd):
    """Who holds the lock, from the lock file: 'host H, pid P, started T: COMMAND'."""
    try:
        h = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        text = f"host {h['host']}, pid {h['pid']}, started {h['started']}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "holder unknown: its lock file names none yet (it is starting)"
    if h.get("command"):
        text += f": {h['command']}"
    if h["host"] == socket.gethostname() and not process_running(h["pid"]):
        text += (f"; pid {h['pid']} is not running on this machine: a process it started "
                 "may still hold the lock")
    return text


def _not_writable(label, folder, err):
    file = getattr(err, "filename", None)
    where = f" ({file})" if file and os.path.abspath(file) != os.path.abspath(folder) else ""
    return f"{label} {folder} cannot be written: {err.strerror or err}{where}"


def lock_folder(folder, label="the output folder"):
    """Take `folder`'s lock in this process (creating the folder): a `FolderLock`;
    `FolderInUse` when another process holds it, `FolderNotWritable` when the folder or its
    lock file cannot be created."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise FolderNotWritable(_not_writable(label, folder, err)) from None
    path = os.path.join(folder, LOCK_FILE)
    kind = filesystem_type(folder)
    notes = []
    if _is_network(kind):
        notes.append(f"{folder} is on a {kind} file system, where the lock {path} may not keep "
                     "out a job on another machine: start one job per output folder")
    for _ in range(10):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise FolderNotWritable(_not_writable(label, folder, err)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise FolderInUse(f"{folder} is in use by another job ({holder}); it holds {path}: "
                              "wait for that job to end or choose another output folder") from None
        except OSError as err:  # no flock here (ENOLCK, EOPNOTSUPP, ...): never wait, go on
            os.close(fd)
            notes.append(f"cannot lock {path} ({err.strerror or err}; file system "
                         f"{kind or 'unknown'}): going on WITHOUT the lock: start one job per "
                         "output folder")
            return FolderLock(folder, None, notes)
        try:  # the file locked must still be the one at `path` (not deleted meanwhile)
            st, own = os.stat(path), os.fstat(fd)
            if (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    else:
        raise FolderInUse(f"{folder}: its lock file {path} keeps being replaced; is another job "
                          "deleting it?")
    lock = FolderLock(folder, fd, notes)
    try:
        write_in_place(fd, json.dumps(_holder()) + "\n")
    except OSError as err:
        lock.release()
        raise FolderNotWritable(_not_writable(label, folder, err)) from None
    return lock


def probe_writable(folder, label="the output folder"):
    """Create `folder` and write and delete a probe file in it through the atomic writer;
    `FolderNotWritable` (one line: the folder and the reason) when that fails."""
    probe = os.path.join(folder, PROBE_FILE)
    try:
        os.makedirs(folder, exist_ok=True)
        atomic_write(probe, f"{socket.gethostname()} {os.getpid()}\n")
        os.remove(probe)
    except OSError as err:
        raise FolderNotWritable(_not_writable(label, folder, err)) from None


def claim_folder(folder, writable=(), group=None):
    """All ranks: rank 0 takes `folder`'s lock and checks that `folder` and each
    `(label, path)` of `writable` can be written; every rank learns the outcome and raises the
    same `FolderInUse` or `FolderNotWritable`, or returns a `FolderLock` (held on rank 0)."""
    rank, world = pd.group_rank_size(group)
    lock, outcome, original = None, None, None
    if rank == 0:
        try:
            lock = lock_folder(folder)
            probe_writable(folder)
            for label, path in writable:
                probe_writable(path, label)
        except (FolderInUse, FolderNotWritable) as err:
            outcome = [type(err).__name__, str(err)]
        except Exception as err:  # a bug: the other ranks must not wait for rank 0
            original, outcome = err, ["RuntimeError", f"rank 0 failed to claim {folder}: {err!r}"]
    if world > 1:
        outcome = _exchange(outcome, group)[0]
    if outcome is None:
        return lock if lock is not None else FolderLock(folder)
    if lock is not None:
        lock.release()
    if original is not None:
        raise original
    kind = {"FolderInUse": FolderInUse, "FolderNotWritable": FolderNotWritable}.get(outcome[0],
                                                                                    RuntimeError)
    raise kind(outcome[1])


def run_folder_of(path):
    """The run folder `path` writes into when it lies in a run's `checkpoints/` folder
    (`<run>/checkpoints/<name>`), else None."""
    parent = os.path.dirname(os.path.abspath(path))
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None
