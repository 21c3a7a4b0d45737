"""plsc.data.pool.in_order, the preparation tools' pool: the results of a plain `map`, in order,
whatever signals its workers are sent; an early end, an exception and a killed worker each end
every worker; workers whose main process is killed end by themselves."""
import json
import os
import subprocess
import sys
import time

from processes import alive

_CASES = """
import json, multiprocessing, os, signal, time
from plsc.data import WorkerDied
from plsc.data.pool import in_order

def square(item):  # the first items' workers send themselves SIGTERM and SIGINT
    if item < 2:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.001)
    return item * item

def fails(item):
    if item == 37:
        raise KeyError(f"item {item}")
    return item

def dies(item):
    if item == 50:
        os.kill(os.getpid(), signal.SIGKILL)
    return item

def children():
    return len(multiprocessing.active_children())

out = {"ordered": [list(in_order(square, range(n), workers=w)) == [i * i for i in range(n)]
                   for w in (2, 3) for n in (0, 5, 150) for _ in range(4)]}
out["ordered"].append(list(in_order(abs, range(-5, 5))) == list(map(abs, range(-5, 5))))
out["children_after_ordered"] = children()
it = in_order(square, range(10 ** 6), workers=2)
out["first"] = [next(it) for _ in range(3)]
it.close()
out["children_after_close"] = children()
try:
    list(in_order(fails, range(100), workers=2))
except KeyError as err:
    out["raised"] = [str(err), any("in a data preparation worker" in n for n in err.__notes__)]
out["children_after_error"] = children()
try:
    list(in_order(dies, range(100), workers=2, advice="--workers"))
except WorkerDied as err:
    out["died"] = str(err)
out["children_after_death"] = children()
print(json.dumps(out))
"""


def _run(code, timeout=120):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


def test_results_signals_early_end_errors_and_deaths():
    proc = _run(_CASES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["ordered"] == [True] * 25 and out["children_after_ordered"] == 0
    assert out["first"] == [0, 1, 4] and out["children_after_close"] == 0
    assert out["raised"] == ["'item 37'", True] and out["children_after_error"] == 0
    assert out["died"].startswith("a data preparation worker died (pid ")
    assert out["died"].endswith("killed by signal 9 (SIGKILL)); if it ran out of memory, lower --workers")
    assert out["children_after_death"] == 0


_ORPHANS = """
import multiprocessing, os, signal, time
from plsc.data.pool import in_order

def slow(item):
    time.sleep(0.05)
    return item

it = in_order(slow, range(10 ** 6), workers=2)
next(it)
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_of_a_killed_main_process_end_by_themselves(tmp_path):
    out = tmp_path / "pids"
    with open(out, "w") as f:  # a file, not a pipe: live workers would hold the pipe open
        code = subprocess.run([sys.executable, "-c", _ORPHANS], stdout=f, timeout=120).returncode
    pids = [int(p) for p in out.read_text().split()]
    assert code == -9 and len(pids) == 2, out.read_text()
    deadline = time.monotonic() + 10
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for pid in left:
        os.kill(pid, 9)
    assert left == []
