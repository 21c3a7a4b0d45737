"""The planner against what this machine measures: the payload of each collective of a real
training step on 2, 3 and 4 gloo ranks (counted at Paddle's collective entry points while the
step runs, tests/plan_ranks.py), the head's bytes per class against the arrays a real head and
optimizer allocate, and tools/plan.py's command line (a plan, a configuration that does not fit:
one line, exit status 2)."""
import os
import subprocess
import sys

import pytest

from plan_ranks import CASES
from trainer_common import config, make_data

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(str(tmp_path_factory.getbasetemp() / "plan_data"))


def _case_config(data, name):
    sections = {k: dict(v) for k, v in CASES[name].items()}
    sections.setdefault("Model", {}).setdefault("name", "IResNetTiny")
    sections["Data"] = dict(sections.get("Data", {}), batch_size=3)
    return config(data, "/tmp/unused", **sections)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collective_payloads_equal_the_bytes_a_real_step_moves(world, data, tmp_path, run_ranks):
    from plsc.train.plan import plan
    done = run_ranks(os.path.join(HERE, "plan_ranks.py"), world,
                     ["--data", data, "--out", str(tmp_path)], cwd=str(tmp_path), timeout=600)
    assert done.status == 0 and all(done.reports), done.tail()
    for name in CASES:
        predicted = plan(_case_config(data, name), world, "cpu").collectives
        want = sorted((c.op, c.dtype, c.payload) for c in predicted)
        for rank, report in enumerate(done.reports):
            got = sorted(tuple(call) for call in report[name])
            assert got == want, f"{name}, rank {rank} of {world}"


def test_head_bytes_per_class_equal_a_real_heads_arrays(data):
    """Bytes per class times a real shard's classes = the arrays a real head and its optimizer
    hold (plsc.storage.nbytes of each), for each storage and optimizer."""
    from plsc import storage
    from plsc.nn import PartialFC
    from plsc.train.builders import build_head_optimizer, build_margin_from_config
    from plsc.train.plan.head import head_arrays_per_class
    for loss, opt in [({"param_dtype": "int8"}, {"head_state_dtype": "int4"}),
                      ({"param_dtype": "bfloat16", "sub_centers": 3}, {"name": "adamw"}),
                      ({"margin": "softmax", "param_dtype": "float16"}, {})]:
        cfg = config(data, "/tmp/unused", Loss=dict(loss, num_classes=1000), Optimizer=opt,
                     Model={"embedding_size": 136})
        head = PartialFC(136, 1000, build_margin_from_config(cfg["Loss"]),
                         param_dtype=cfg["Loss"]["param_dtype"],
                         sub_centers=cfg["Loss"]["sub_centers"])
        arrays = [head.weight] + ([head.bias] if head.bias is not None else [])
        arrays += [a for k, a in build_head_optimizer(cfg, 0.1).init_state(head).items()
                   if k != "step_count"]
        real = sum(storage.nbytes(a) for a in arrays)
        assert sum(head_arrays_per_class(cfg).values()) * 1000 == real, (loss, opt)


def _tool(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_tool_plans_the_demo_and_refuses_what_does_not_fit(data):
    done = _tool("-c", "configs/demo.yaml", "-o", f"Data.root={data}")
    assert done.returncode == 0, done.stderr
    assert "largest Loss.num_classes that fits" in done.stdout
    assert "features all-gather" in done.stdout
    done = _tool("-c", "configs/demo.yaml", "-o", f"Data.root={data}", "-o",
                 "Loss.num_classes=400000000", "--device", "v100-32gb", "--ranks", "8")
    assert done.returncode == 2 and done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "does not fit" in lines[0] and "over" in lines[0]
    assert "Loss.param_dtype=int8" in lines[0] and "--ranks 16" in lines[0]


def test_tool_help_shows_three_examples():
    done = _tool("--help")
    assert done.returncode == 0
    assert done.stdout.count("python tools/plan.py -c") == 3


def test_peer_head_bytes_equal_a_direct_count_of_its_arrays():
    """arcface_torch's head (plan/peers.py) against the arrays of its code counted here by hand:
    C classes a rank, S = int(0.1 C) sampled, N gathered samples, d, 4-byte floats."""
    from plsc.train.plan import peers
    C, d, N, world = 1000, 16, 64, 8
    S, rows = 100, 8
    v1 = peers.head_phases("v1", C, d, 0.1, N, world)
    # weight, weight_mom; sub_weight, its momentum, normalize(sub_weight); logits, the
    # clone saved by acos_, logits_exp, the incoming gradient, acos' six temporaries; the
    # margin's one-hot and grad[index] rows
    assert sum(v1["backward"].values()) == 4 * (2 * C * d + 3 * S * d + 10 * N * S + 2 * rows * S)
    # weight, weight_mom; sub_weight, its momentum, its gradient, SGD's weight-decay copy
    assert sum(v1["step"].values()) == 4 * (2 * C * d + 4 * S * d)
    v2 = peers.head_phases("v2", C, d, 0.1, N, world, "sgd")
    assert sum(v2["step"].values()) == 4 * 4 * C * d  # weight, dense grad, momentum, wd copy
    v2 = peers.head_phases("v2", C, d, 0.1, N, world, "adamw")
    assert sum(v2["step"].values()) == 4 * 5 * C * d  # weight, grad, two moments, sqrt copy
    assert peers.per_class_bytes("v2", 512, 0.1, 1024, 8) == 16 * 512
    assert peers.head_peak("v1", C, d, 0.1, N, world)[0] == "backward"
