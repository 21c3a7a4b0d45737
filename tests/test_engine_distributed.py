"""The engine on real gloo ranks: k ranks equal one process; resume on another world size."""
import os
import subprocess
import sys

import numpy as np
import pytest

from engine_common import make_data
from oracles import rel_err

HERE = os.path.dirname(os.path.abspath(__file__))
_runs = {}


def run_group(tmp_path_factory, key, nprocs, mode, checkpoint=None):
    if key not in _runs:
        data = make_data(str(tmp_path_factory.getbasetemp() / "engine_data"))
        out = str(tmp_path_factory.mktemp(key))
        cmd = [sys.executable, os.path.join(HERE, "engine_ranks.py"), "--nprocs", str(nprocs),
               "--mode", mode, "--data", data, "--out", out]
        if checkpoint:
            cmd += ["--checkpoint", checkpoint]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=out)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{key}: timed out (hang?)\n{(e.stderr or '')[-3000:]}")
        if proc.returncode != 0:
            pytest.fail(f"{key} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
        _runs[key] = (out, dict(np.load(os.path.join(out, "result.npz"))))
    return _runs[key]


@pytest.mark.parametrize("world_size", [2, 3])
def test_k_ranks_equal_one_process(world_size, tmp_path_factory):
    """Two SGD steps (momentum, weight decay, clipping) on k ranks vs one process, same global batches."""
    _, single = run_group(tmp_path_factory, "single", 1, "invariant")
    _, multi = run_group(tmp_path_factory, f"ranks{world_size}", world_size, "invariant")
    assert set(single) == set(multi)
    for key in single:
        assert rel_err(multi[key], single[key]) < 1e-5, (key, rel_err(multi[key], single[key]))
    from engine_ranks import full_classifier
    assert rel_err(single["head"], full_classifier()) > 1e-3  # the steps did move the classifier


def test_resume_on_three_ranks_reshards_the_head(tmp_path_factory):
    """A checkpoint written by 2 ranks, resumed on 3: every class row and its momentum land on
    the rank that now owns them, the backbone is restored, and training goes on."""
    out2, two = run_group(tmp_path_factory, "ranks2", 2, "invariant")
    ckpt = os.path.join(out2, "run", "checkpoints", "step_00000002")
    _, three = run_group(tmp_path_factory, "resume3", 3, "resume", checkpoint=ckpt)
    assert int(three["step"]) == 2 and int(three["num_local"]) == 8
    np.testing.assert_array_equal(three["head"], two["head"])
    np.testing.assert_array_equal(three["velocity"], two["velocity"])
    for key in two:
        if key.startswith("backbone."):
            np.testing.assert_array_equal(three[key], two[key])
