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


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_launch_on_loopback(tmp_path_factory):
    """Two `paddle.distributed.launch --nnodes 2` processes, one rank each, train and agree."""
    import json
    data = make_data(str(tmp_path_factory.getbasetemp() / "engine_data"))
    out = str(tmp_path_factory.mktemp("two_nodes"))
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "paddle.distributed.launch", "--nnodes", "2", "--master",
         f"127.0.0.1:{port}", "--rank", str(node), "--nproc_per_node", "1", "--log_dir",
         os.path.join(out, f"log{node}"), os.path.join(HERE, "two_node_worker.py"), data, out],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=out) for node in (0, 1)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("two-node launch timed out")
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-4000:]
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert len(ranks[0]["losses"]) == 4 and ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["backbone"] == ranks[1]["backbone"]


def test_demo_config_end_to_end_shortened(tmp_path_factory):
    """configs/demo.yaml on 2 launched ranks, shortened: trains, evaluates, logs, checkpoints."""
    out = str(tmp_path_factory.mktemp("demo"))
    data = os.path.join(out, "data")
    root = os.path.dirname(HERE)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
           os.path.join(out, "log"), os.path.join(root, "tools", "train.py"),
           "-c", os.path.join(root, "configs", "demo.yaml"),
           "-o", f"Global.output_dir={out}/run", "-o", "Global.max_steps=12",
           "-o", f"Data.root={data}", "-o", f"Eval.root={data}", "-o", "Eval.interval=6",
           "-o", "Loss.num_classes=60", "-o", "Data.image_size=[32, 32]", "-o", "Data.batch_size=16",
           "-o", "Data.synthetic={num_identities: 60, images_per_identity: 8, "
                 "num_val_identities: 20, num_pairs: 100}",
           "-o", "Checkpoint.interval=6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=out)
    log = open(os.path.join(out, "run", "train.log")).read() if os.path.exists(
        os.path.join(out, "run", "train.log")) else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for step in (0, 6, 12):
        assert f"[val] step {step} accuracy" in log, log
    assert "step 12/12" in log
    ckpt = os.path.join(out, "run", "checkpoints", "step_00000012")
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("head_rank")) == ["head_rank0", "head_rank1"]
    assert os.listdir(os.path.join(out, "run", "vdl"))
