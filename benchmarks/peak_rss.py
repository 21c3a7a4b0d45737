"""Run a command and report the peak resident memory (VmHWM) of each of its processes.

    python benchmarks/peak_rss.py -- python -m paddle.distributed.launch --nproc_per_node 2 \
        tools/train.py -c configs/demo.yaml

Polls /proc every --interval seconds for the command's descendants and prints one JSON line
at the end: each process's peak RSS (its kernel-kept high-water mark, so short peaks between
polls are counted too, for processes alive at a poll), their sum, the machine's total, and
`tree_peak_rss_bytes`: the largest high-water mark of any process of the command's tree once
all are reaped (the kernel's `RUSAGE_CHILDREN` maximum), which also holds what a process
reached after the last poll (a final checkpoint just before it exits). Linux only.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time


def children(pid):
    """All descendants of `pid` (from /proc/*/stat)."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                parent[int(name)] = int(fields[1])
            except OSError:
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def status(pid):
    """(command line, VmHWM bytes) of `pid`, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            hwm = next((int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM")), 0)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        return cmd, hwm
    except OSError:
        return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--interval", type=float, default=0.5, help="seconds between polls")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command (after --)")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("give the command to run after --")
    try:
        proc = subprocess.Popen(cmd)
    except OSError as err:
        p.error(f"cannot run {cmd[0]!r}: {err.strerror}")
    peaks = {}
    while proc.poll() is None:
        for pid in [proc.pid] + children(proc.pid):
            st = status(pid)
            if st is not None and st[1] > peaks.get(pid, ("", 0))[1]:
                peaks[pid] = st
        time.sleep(args.interval)
    with open("/proc/meminfo") as f:
        total = int(next(l for l in f if l.startswith("MemTotal")).split()[1]) * 1024
    big = {pid: v for pid, v in peaks.items() if v[1] > 64 << 20}
    tree = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"returncode": proc.returncode, "mem_total_bytes": total,
                      "tree_peak_rss_bytes": tree,
                      "peak_rss_bytes": {str(pid): hwm for pid, (_, hwm) in big.items()},
                      "commands": {str(pid): c[:200] for pid, (c, _) in big.items()},
                      "sum_peak_rss_bytes": sum(h for _, h in big.values())}), flush=True)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
