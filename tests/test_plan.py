"""The planner against what this machine measures: the payload of each collective of a real
training step on 2, 3 and 4 gloo ranks (counted at Paddle's collective entry points while the
step runs, tests/plan_ranks.py), the head's bytes per class against the arrays a real head and
optimizer allocate, and tools/plan.py's command line (a plan, a configuration that does not fit:
one line, exit status 78; a bad input stays 2): every shipped config on every device profile plans or says so in that
line, each fix it names fits when planned again, and where it says more ranks cannot help, the
term it names does not shrink with more ranks."""
import dataclasses
import glob
import os
import re
import subprocess
import sys

import pytest

import scripts
from plan_ranks import CASES
from plsc.process.exits import CONFIG_ERROR_EXIT_CODE, DOES_NOT_FIT_EXIT_CODE
from plsc.train.plan.devices import PROFILES
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
    for rank, report in enumerate(done.reports):  # plsc.distributed.gloo_group's groups
        rest = sum(range(2, world + 1)) if rank else None
        assert report.pop("gloo_groups") == [world * (world + 1) / 2, rest], rank
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
    assert done.returncode == DOES_NOT_FIT_EXIT_CODE and done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "does not fit" in lines[0] and "over" in lines[0]
    assert "Loss.param_dtype=int8" in lines[0] and "--ranks 16" in lines[0]


def test_tool_help_shows_three_examples_and_what_does_not_fit_prints():
    done = _tool("--help")
    assert done.returncode == 0
    assert done.stdout.count("python tools/plan.py -c") == 3
    assert f"status {DOES_NOT_FIT_EXIT_CODE}" in done.stdout and "more ranks cannot help" in done.stdout


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


# Every shipped config on every profile of the planner's table and on the default (no --device,
# this machine's CPU), and the issue's two recipes at 1,024 images a V100.
CONFIGS = sorted(os.path.relpath(c, ROOT) for c in glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
MATRIX = [(c, ["--device", d] if d else []) for c in CONFIGS for d in (None, *PROFILES)]
MATRIX += [(c, ["--device", "v100-32gb", "-o", "Data.batch_size=1024"])
           for c in ("configs/arcface_r50.yaml", "configs/glint360k_r100_pfc.yaml")]


@pytest.fixture(scope="module")
def tool():
    return scripts.load("tools/plan.py")


def _run(tool, capsys, argv):
    """tools/plan.py in this process: (status, stdout, stderr)."""
    code = tool.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _fits(tool, capsys, argv):
    """The planner's own verdict on `argv`: status 0 (plans) or 78 with its one line."""
    code, out, err = _run(tool, capsys, argv)
    assert code in (0, DOES_NOT_FIT_EXIT_CODE) and (code == 0) == ("largest Loss.num_classes that fits" in out), err
    return code == 0


def _fixes(line):
    """{fix as given: its needed bytes' text} of the fixes the line says fit."""
    listed = line.split("would fit with: ", 1)[1].split("; more ranks")[0].split("; saves")[0]
    return re.findall(r"(\S+(?: \d+)?) \(fits: needs ([^)]+)\)", listed)


def _argv_with(argv, fix):
    if fix.startswith("--ranks "):
        return [a for a in argv] + fix.split()
    return list(argv) + ["-o", fix]


def _ranks(argv):
    if "--ranks" in argv:
        return int(argv[argv.index("--ranks") + 1])
    return 8 if "--device" in argv and argv[argv.index("--device") + 1] != "cpu" else 2


def _check_stop(config_path, argv, line):
    """Where the line says more ranks cannot help, what it names does not shrink with ranks."""
    from plsc.config import load_config
    from plsc.distributed import ClassPartition
    from plsc.train.plan import plan
    stop = line.split("more ranks cannot help: ", 1)[1].split("; ")[0]
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    cfg = load_config(os.path.join(ROOT, config_path), overrides)
    device = argv[argv.index("--device") + 1] if "--device" in argv else "cpu"
    r = _ranks(argv)
    asked = plan(cfg, r, device)
    m = re.match(r"([\d,]+) classes cannot be split over (\d+) ranks", stop)
    if m:  # the partition's own rule refuses the next rank count
        with pytest.raises(ValueError):
            ClassPartition(int(m.group(1).replace(",", "")), int(m.group(2)))
        return "classes"
    more = [plan(cfg, k, device) for k in (2 * r, 4 * r)]
    m = re.match(r"the ranks share this machine's", stop)
    if m:  # one machine's memory: each rank's share shrinks, what they need in all does not
        for p in more:
            assert p.limit < asked.limit
            assert p.total * p.ranks >= asked.total * r > asked.limit * r
            assert p.total - p.limit > asked.total - asked.limit
        return "shared"
    m = re.search(r"the largest: (.+) [\d.]+ [KMGT]?i?B\)$", stop)
    assert m, line
    term = m.group(1)
    assert asked.memory[term] > 0
    for p in more:  # the term named does not shrink, and the plan still does not fit
        assert p.memory[term] >= asked.memory[term], (term, p.ranks)
        assert p.total > p.limit
    return "kept"


@pytest.mark.parametrize("config_path,argv", MATRIX,
                         ids=[f"{os.path.basename(c)}{'-' + '-'.join(a) if a else ''}"
                              for c, a in MATRIX])
def test_every_shipped_config_plans_or_says_in_one_line_why_not(tool, capsys, config_path, argv):
    """Status 0 and a plan, or status 78, nothing on stdout and one line on stderr: "does not
    fit", each fix it says fits planned again (fits; the batch size is the largest that does),
    and where more ranks cannot help, the reason checked (see _check_stop)."""
    argv = ["-c", config_path] + argv
    code, out, err = _run(tool, capsys, argv)
    if code == 0:
        assert "largest Loss.num_classes that fits" in out and "error" not in err
        return
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == DOES_NOT_FIT_EXIT_CODE and out == "" and len(lines) == 1, err
    line = lines[0]
    assert line.startswith("error: does not fit: rank 0 needs"), line
    for fix, _ in _fixes(line):
        assert _fits(tool, capsys, _argv_with(argv, fix)), fix
        if fix.startswith("Data.batch_size="):
            bigger = f"Data.batch_size={int(fix.split('=')[1]) + 1}"
            assert not _fits(tool, capsys, _argv_with(argv, bigger)), fix
    if "more ranks cannot help" in line:
        _check_stop(config_path, argv, line)
    else:  # the search found a rank count
        assert any(f.startswith("--ranks") for f, _ in _fixes(line)), line


def test_a_batch_no_rank_count_holds_names_the_activations_and_the_fixes(tool, capsys):
    """The issue's case: IResNet50 at 1,024 images a V100 does not fit on any number of ranks
    (its activations do not shrink with them); recompute (measured for IResNet50) and a lower
    batch size do fit, and the line says both."""
    argv = ["-c", "configs/arcface_r50.yaml", "--device", "v100-32gb", "-o",
            "Data.batch_size=1024"]
    code, _, err = _run(tool, capsys, argv)
    assert code == DOES_NOT_FIT_EXIT_CODE
    assert "the largest: backbone activations" in err
    assert _check_stop("configs/arcface_r50.yaml", argv, err.strip()) == "kept"
    fixes = dict(_fixes(err))
    assert "Model.recompute=true" in fixes
    assert any(f.startswith("Data.batch_size=") for f in fixes)


def test_on_this_machine_more_ranks_share_it_and_fewer_are_tried(tool, capsys):
    """cpu: the ranks share the machine, so the search goes down; arcface_r50 at 2 ranks does
    not fit, 1 rank does (the line says --ranks 1, which plans)."""
    argv = ["-c", "configs/arcface_r50.yaml"]
    code, _, err = _run(tool, capsys, argv)
    assert code == DOES_NOT_FIT_EXIT_CODE and "the ranks share this machine's" in err
    assert "--ranks 1" in dict(_fixes(err))
    assert _fits(tool, capsys, argv + ["--ranks", "1"])


def test_the_search_stops_at_a_class_count_the_ranks_cannot_split(tool, capsys, monkeypatch):
    """10 classes of 16 sub-centres on a GPU whose memory is one byte short of what 4 ranks
    need: more ranks keep helping (the head shrinks) until 8 ranks, over which 10 classes
    cannot be split (ceil(10/8) = 2 classes a shard leaves ranks 5-7 none)."""
    from plsc.config import load_config
    from plsc.train.plan import plan
    over = ["Loss.num_classes=10", "Loss.sub_centers=16", "Data.batch_size=1"]
    cfg = load_config(os.path.join(ROOT, "configs/demo.yaml"), over)
    two, four = plan(cfg, 2, "v100-32gb").total, plan(cfg, 4, "v100-32gb").total
    assert four < two
    small = dataclasses.replace(PROFILES["v100-32gb"], name="small-gpu", memory_bytes=four - 1)
    monkeypatch.setitem(PROFILES, "small-gpu", small)
    monkeypatch.setattr(tool, "parser", _parser_with(tool.parser, "small-gpu"))
    argv = ["-c", "configs/demo.yaml", "--device", "small-gpu", "--ranks", "2"]
    for o in over:
        argv += ["-o", o]
    code, _, err = _run(tool, capsys, argv)
    assert code == DOES_NOT_FIT_EXIT_CODE and len(err.strip().splitlines()) == 1, err
    assert "more ranks cannot help: 10 classes cannot be split over 8 ranks" in err
    assert _check_stop("configs/demo.yaml", argv, err.strip()) == "classes"


def _parser_with(parser, device):
    def make():
        p = parser()
        for action in p._actions:
            if action.dest == "device":
                action.choices = (*action.choices, device)
        return p
    return make


def test_the_issue_commands_end_without_a_traceback():
    """The commands of issue 59 as a user runs them (a process each: no traceback on stderr)."""
    for args in (["-c", "configs/arcface_r50.yaml"],
                 ["-c", "configs/glint360k_r100_pfc.yaml", "--device", "v100-32gb", "-o",
                  "Data.batch_size=1024"]):
        done = _tool(*args)
        assert done.returncode == DOES_NOT_FIT_EXIT_CODE and done.stdout == "", done.stderr
        assert "Traceback" not in done.stderr
        assert [x for x in done.stderr.splitlines() if x.startswith("error:")] == [
            next(x for x in done.stderr.splitlines() if x.startswith("error: does not fit"))]
