"""Automatic restart through Paddle's own elastic launcher: with an etcd master,
`paddle.distributed.launch --elastic_level 1 --max_restart N` restarts the ranks after one is
killed, `Global.checkpoint: auto` resumes them, and the run ends with the uninterrupted run's
weights bit for bit.

Needs the etcd server (Debian: etcd-server) and its Python client (`pip install
plsc[elastic]`, i.e. etcd3, imported with PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python);
skipped where either is missing. CI (.ci/run) installs both (etcd-server from the system
packages, etcd3 from the `test` extra) and sets PLSC_REQUIRE_ETCD=1, which turns the skip into
a failure: CI runs this test or fails.
"""
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from test_preemption import final_state, launch

ENV_PROTOBUF = {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}  # what etcd3 needs


def _etcd3_importable():
    return subprocess.run([sys.executable, "-c", "import etcd3"],
                          env=dict(os.environ, **ENV_PROTOBUF), capture_output=True).returncode == 0


MISSING = [what for what, ok in (("the etcd server (etcd-server)", shutil.which("etcd") is not None),
                                 ("the etcd3 client (plsc[elastic])", _etcd3_importable())) if not ok]
REQUIRED = os.environ.get("PLSC_REQUIRE_ETCD") == "1"  # set by .ci/run
pytestmark = pytest.mark.skipif(bool(MISSING) and not REQUIRED,
                                reason="needs " + " and ".join(MISSING))


@pytest.fixture(scope="module", autouse=True)
def _etcd_present():
    if MISSING:  # only reached with PLSC_REQUIRE_ETCD=1
        pytest.fail(f"PLSC_REQUIRE_ETCD=1 but {' and '.join(MISSING)} missing")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd(tmp_path):
    client, peer = free_port(), free_port()
    proc = subprocess.Popen(["etcd", "--data-dir", str(tmp_path / "etcd"),
                             "--listen-client-urls", f"http://127.0.0.1:{client}",
                             "--advertise-client-urls", f"http://127.0.0.1:{client}",
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", client)) == 0:
                break
        time.sleep(0.2)
    yield f"etcd://127.0.0.1:{client}"
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def data_root(tmp_path_factory):
    from trainer_common import make_data
    return make_data(str(tmp_path_factory.mktemp("synthetic")))


def test_killed_rank_is_restarted_and_the_run_finishes_exactly(tmp_path, data_root, etcd,
                                                               run_ranks):
    plain = tmp_path / "plain"
    plain.mkdir()
    done = launch(run_ranks, plain, data_root)
    assert done.status == 0, done.tail()
    expected = final_state(str(plain / "out"))

    run = tmp_path / "elastic"
    run.mkdir()
    done = launch(run_ranks, run, data_root, 1, 3, 0, interval=2,  # the restart resumes at 2
                  launch_args=["--master", etcd, "--nnodes", "1", "--elastic_level", "1",
                               "--max_restart", "3", "--job_id", f"plsc_{os.getpid()}"],
                  env=dict(ENV_PROTOBUF, PREEMPT_SIGNAL="KILL",
                           PREEMPT_ONCE=str(run / "killed_once")))
    assert done.status == 0, done.tail(4000)
    assert os.path.exists(run / "killed_once"), "rank 1 was never killed"
    assert "Pod failed" in done.output and "Pod completed" in done.output
    log0 = done.logs[0]  # both runs of rank 0, one after the other
    assert "rank 1 stopped answering after step 3" in log0
    assert "resuming from" in log0 and "step_00000002 at step 2" in log0
    got = final_state(str(run / "out"))
    assert set(got) == set(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
