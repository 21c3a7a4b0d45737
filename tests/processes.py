"""Processes as Linux's /proc shows them: the tests' checks that a process is gone."""
import os


def _stat(pid):
    """The fields of /proc/PID/stat after the command name (state, parent, group, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _all():
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := _stat(name)) is not None:
            yield int(name), fields


def alive(pid):
    """Whether `pid` runs (a zombie has ended)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def children(pid):
    """The pids whose parent is `pid`."""
    return [p for p, fields in _all() if int(fields[1]) == pid]


def in_group(pgid):
    """The running pids of process group `pgid`."""
    return [p for p, fields in _all() if int(fields[2]) == pgid and fields[0] not in ("Z", "X")]
