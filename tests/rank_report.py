"""A rank's report to the test that started it: one file per rank in the folder named by
$PLSC_TEST_REPORTS (set by conftest.py's `run_ranks`, which reads them back in rank order).

A report is JSON (`write`) or, for arrays whose dtype matters, an .npz (`write_arrays`).
"""
import json
import os

import numpy as np

ENV = "PLSC_TEST_REPORTS"


def _rank(rank):
    return int(os.environ.get("PADDLE_TRAINER_ID", "0")) if rank is None else rank


def _path(rank, ext):
    return os.path.join(os.environ[ENV], f"rank{_rank(rank)}{ext}")


def write(obj, rank=None):
    """This rank's (or `rank`'s) report: a JSON-serialisable object."""
    path = _path(rank, ".json")
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def write_arrays(arrays, rank=None):
    """This rank's (or `rank`'s) report: named arrays, kept with their dtypes."""
    path = _path(rank, ".npz")
    with open(path + ".tmp", "wb") as f:
        np.savez(f, **arrays)
    os.replace(path + ".tmp", path)


def read(folder, nranks):
    """[report of rank r or None] for r below `nranks` or the highest rank that wrote one."""
    found = {}
    for name in os.listdir(folder):
        stem, ext = os.path.splitext(name)
        if stem.startswith("rank") and stem[4:].isdigit() and ext in (".json", ".npz"):
            path = os.path.join(folder, name)
            if ext == ".json":
                with open(path) as f:
                    found[int(stem[4:])] = json.load(f)
            else:
                with np.load(path) as z:
                    found[int(stem[4:])] = dict(z)
    return [found.get(r) for r in range(max([nranks - 1, *found]) + 1)]
