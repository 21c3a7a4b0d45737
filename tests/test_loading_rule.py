"""The one rule for loading backbone weights (plsc.loading), on every path that loads them:
the tools (in process, through their main), Entry, the trainer's resume and Global.pretrained.

A checkpoint trained at 16x16 with IResNetTiny and 32-d embeddings is refused, in one line
naming both values and the -o that matches, by a config of another image size, embedding size
or backbone; a .pdparams that does not fit is refused naming the tensor and both shapes; a
refused load changes nothing. (tools/search.py reads embeddings only: no weights to load.)"""
import ast
import glob
import os

import numpy as np
import paddle
import pytest
from paddle import nn

import scripts
from ijb_layout import make_layout
from trainer_common import IMAGE, config, make_data
from plsc.config import ConfigError
from plsc.models import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDING = 32
# (override, what the checkpoint says, the -o that matches): written out by hand from the run's
# settings (IResNetTiny, 32-d, 16x16), not from the code's output.
MISMATCHES = {
    "image_size": ("Data.image_size=[24,24]", "Data.image_size=[16, 16]; the config has [24, 24]",
                   '-o "Data.image_size=[16,16]"'),
    "embedding_size": ("Model.embedding_size=16", "Model.embedding_size=32; the config has 16",
                       "-o Model.embedding_size=32"),
    "backbone": ("Model.name=IResNet18", "Model.name=IResNetTiny; the config has IResNet18",
                 "-o Model.name=IResNetTiny"),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One training step of IResNetTiny (K=2 sub-centres, so that tools/clean_subcenters.py
    accepts it) with a checkpoint; its config.yaml, data and an IJB layout for the tools."""
    from plsc.train import Trainer
    base = tmp_path_factory.mktemp("loading_rule")
    data = make_data(str(base / "data"))
    out = str(base / "run")
    cfg = config(data, out, Global={"max_steps": 1}, Checkpoint={"interval": 1},
                 Loss={"sub_centers": 2}, Model={"name": "IResNetTiny", "embedding_size": EMBEDDING})
    trainer = Trainer(cfg)
    trainer.train()
    ckpt = os.path.realpath(os.path.join(out, "checkpoints", "step_00000001"))
    assert os.path.isdir(ckpt)
    ijb = str(base / "IJB_release" / "IJBC")
    make_layout(ijb, num_identities=2, templates_per_identity=2)
    distractors = base / "distractors.txt"  # never read: the probes' model is refused first
    distractors.write_text("x.jpg\n")
    return {"cfg": cfg, "yaml": os.path.join(out, "config.yaml"), "data": data, "out": out,
            "ckpt": ckpt, "ijb": ijb, "distractors": str(distractors), "base": base,
            "backbone": {k: v.numpy().copy() for k, v in trainer.backbone.state_dict().items()}}


def _tools(run, tmp):
    """Each tool that loads a trained backbone: (script, its arguments besides -c/-o, what a
    refused run must not have written)."""
    return [
        ("tools/eval.py", ["-o", f"Eval.root={run['data']}", "-o", "Eval.targets=[val]"],
         os.path.join(run["out"], "roc.png")),
        ("tools/export.py", ["--output", str(tmp / "export")], str(tmp / "export")),
        ("tools/extract.py", ["--input", run["data"], "--output", str(tmp / "emb.npy")],
         str(tmp / "emb.npy")),
        ("tools/eval_ijb.py", ["--root", run["ijb"], "--target", "IJBC", "-o",
                               f"Global.output_dir={tmp / 'ijb_out'}"], str(tmp / "ijb_out")),
        ("tools/eval_megaface.py", ["--probes", run["data"], "--distractors", run["distractors"],
                                    "-o", f"Global.output_dir={tmp / 'mf_out'}"],
         str(tmp / "mf_out")),
        ("tools/clean_subcenters.py", ["--out", str(tmp / "cleaned")],
         str(tmp / "cleaned" / "checkpoint_k1")),
    ]


def _main(capsys, script, argv):
    """`script`'s main(argv) in this process: (status, stdout, stderr)."""
    tool = scripts.load(script)
    capsys.readouterr()
    code = tool.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _error_line(err):
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_every_tool_refuses_a_checkpoint_of_another_shape(run, kind, tmp_path, capsys):
    override, trained, fix = MISMATCHES[kind]
    for script, args, not_written in _tools(run, tmp_path):
        argv = ["-c", run["yaml"], "-o", f"Global.checkpoint={run['ckpt']}", "-o", override] + args
        code, out, err = _main(capsys, script, argv)
        assert code == 2, (script, code, err)
        line = _error_line(err)
        assert line == (f"error: checkpoint {run['ckpt']} was trained with {trained}: add {fix}"
                        ), (script, line)
        assert not os.path.exists(not_written), script


def test_the_matching_config_passes_the_same_tools(run, tmp_path, capsys):
    """The refusals above come from the rule, not from the tools' other inputs: unchanged,
    export and extract succeed, and export names the checkpoint and each format."""
    code, out, err = _main(capsys, "tools/export.py", ["-c", run["yaml"], "-o",
                                                       "Global.checkpoint=latest", "--output",
                                                       tmp_path / "export", "--no-onnx"])
    assert code == 0, err
    assert out.splitlines() == [f"exported {run['ckpt']} (step 1)",
                                f"paddle: {tmp_path / 'export' / 'inference'}",
                                "onnx: skipped: --no-onnx"]
    code, out, err = _main(capsys, "tools/extract.py", ["-c", run["yaml"], "-o",
                                                        "Global.checkpoint=latest", "--input",
                                                        run["data"], "--output", tmp_path / "e.npy"])
    assert code == 0, err
    assert np.load(tmp_path / "e.npy").shape[1] == EMBEDDING


def test_export_says_why_onnx_was_skipped(run, tmp_path, capsys, monkeypatch):
    """Without paddle2onnx (hidden from the import here, whether installed or not) the ONNX line
    says so; with it, the file is written."""
    import builtins
    real_import = builtins.__import__

    def no_paddle2onnx(name, *args, **kwargs):
        if name == "paddle2onnx":
            raise ImportError("hidden by the test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_paddle2onnx)
    code, out, err = _main(capsys, "tools/export.py", ["-c", run["yaml"], "-o",
                                                       "Global.checkpoint=latest", "--output",
                                                       tmp_path / "a"])
    assert code == 0, err
    assert out.splitlines()[-1] == ('onnx: skipped: paddle2onnx is not installed '
                                    '(pip install -e ".[onnx]")')
    assert not os.path.exists(tmp_path / "a" / "model.onnx")
    monkeypatch.undo()
    try:
        import paddle2onnx  # noqa: F401
    except ImportError:
        return
    code, out, err = _main(capsys, "tools/export.py", ["-c", run["yaml"], "-o",
                                                       "Global.checkpoint=latest", "--output",
                                                       tmp_path / "b"])
    assert code == 0, err
    assert out.splitlines()[-1] == f"onnx: {tmp_path / 'b' / 'model.onnx'}"
    assert os.path.getsize(tmp_path / "b" / "model.onnx") > 1000


def test_a_pdparams_of_another_shape_is_refused_naming_the_tensor(run, tmp_path, capsys):
    """Global.pretrained has no meta.json: the shapes are its rule (eval and export shown)."""
    paddle.seed(3)
    other = build_model("IResNetTiny", embedding_size=EMBEDDING, input_size=24)
    weights = str(tmp_path / "w24.pdparams")
    paddle.save(other.state_dict(), weights)
    model = build_model("IResNetTiny", embedding_size=EMBEDDING, input_size=IMAGE)
    got, want = other.state_dict()["fc.weight"].shape, model.state_dict()["fc.weight"].shape
    assert got != want
    for script, args, not_written in _tools(run, tmp_path)[:2]:
        code, out, err = _main(capsys, script, ["-c", run["yaml"], "-o", "Global.checkpoint=null",
                                                "-o", f"Global.pretrained={weights}"] + args)
        assert code == 2, err
        line = _error_line(err)
        assert line.startswith(f"error: {weights} does not fit the model: fc.weight has shape "
                               f"{list(got)}, the model's is {list(want)}"), line
        assert not os.path.exists(not_written)


def test_convert_weights_refuses_another_size_or_backbone(run, tmp_path, capsys):
    """tools/convert_weights.py has no config: the checkpoint's meta.json names the model, and
    --model or --input-size that differ are refused, the latter by the tensors' shapes."""
    out = tmp_path / "x.pt"
    want = build_model("IResNetTiny", embedding_size=EMBEDDING, input_size=32).state_dict()
    got = run["backbone"]["fc.weight"].shape
    file = os.path.join(run["ckpt"], "backbone.pdparams")
    code, _, err = _main(capsys, "tools/convert_weights.py", ["--to-insightface", run["ckpt"],
                                                              "--input-size", 32, "--output", out])
    assert code == 2 and _error_line(err) == (
        f"error: {file} (read as IResNetTiny with 32-d embeddings at 32x32) does not fit the model: "
        f"fc.weight has shape {list(got)}, the model's is {list(want['fc.weight'].shape)}; nothing "
        "loaded (check --model and --input-size)")
    code, _, err = _main(capsys, "tools/convert_weights.py", ["--to-insightface", run["ckpt"],
                                                              "--model", "r18", "--output", out])
    assert code == 2 and "holds the backbone IResNetTiny, not IResNet18" in _error_line(err)
    assert not out.exists()


@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_entry_refuses_a_checkpoint_of_another_shape(run, kind):
    from plsc import Entry
    override, trained, fix = MISMATCHES[kind]
    ins = Entry.from_config(run["yaml"], ["Global.checkpoint=latest", override,
                                          f"Eval.root={run['data']}", "Eval.targets=[val]"])
    image = np.zeros((IMAGE, IMAGE, 3), np.uint8)
    calls = [ins.test, lambda: ins.predict([image]),
             lambda: ins.convert_for_prediction(str(run["base"] / f"x_{kind}"), onnx=False)]
    for call in calls:
        with pytest.raises(ConfigError) as info:
            call()
        assert str(info.value) == f"checkpoint {run['ckpt']} was trained with {trained}: add {fix}"
    assert not os.path.exists(run["base"] / f"x_{kind}")


def test_entry_with_a_layer_of_another_shape_loads_nothing(run):
    """A backbone given as a Layer is not compared by name, but every tensor must fit; the
    refused Layer keeps its own values."""
    from plsc import Entry
    paddle.seed(5)
    layer = build_model("IResNetTiny", embedding_size=EMBEDDING, input_size=32)
    before = {k: v.numpy().copy() for k, v in layer.state_dict().items()}
    ins = Entry.from_config(run["yaml"], ["Global.checkpoint=latest"]).set_model(layer)
    with pytest.raises(ConfigError, match=r"does not fit the model: fc.weight has shape \[128, 32\], "
                                          r"the model's is \[512, 32\]"):
        ins.predict([np.zeros((IMAGE, IMAGE, 3), np.uint8)])
    after = layer.state_dict()
    assert all(np.array_equal(after[k].numpy(), v) for k, v in before.items())


def test_entry_convert_for_prediction_returns_what_its_doc_says(run, tmp_path):
    """docs/entry_api.md: {'paddle', 'onnx', 'onnx_skipped', 'source', 'step'}; the exported model
    computes what the checkpoint's backbone computes."""
    from plsc import Entry
    ins = Entry.from_config(run["yaml"], ["Global.checkpoint=latest"])
    paths = ins.convert_for_prediction(str(tmp_path / "e"), onnx=False)
    assert paths == {"paddle": str(tmp_path / "e" / "inference"), "onnx": None,
                     "onnx_skipped": "not asked for", "source": run["ckpt"], "step": 1}
    doc = open(os.path.join(ROOT, "docs", "entry_api.md"), encoding="utf-8").read()
    for key in paths:
        assert f"'{key}'" in doc, key
    loaded = paddle.jit.load(paths["paddle"])
    model = build_model("IResNetTiny", embedding_size=EMBEDDING, input_size=IMAGE)
    model.set_state_dict({k: paddle.to_tensor(v) for k, v in run["backbone"].items()})
    model.eval()
    x = paddle.to_tensor(np.random.RandomState(0).normal(size=(2, 3, IMAGE, IMAGE)).astype("float32"))
    want = model(x).numpy()
    assert np.abs(loaded(x).numpy() - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_resume_refuses_a_checkpoint_of_another_shape(run, kind, tmp_path):
    from plsc.train import Trainer
    override, trained, fix = MISMATCHES[kind]
    key, value = override.split("=")
    section, name = key.split(".")
    value = [24, 24] if kind == "image_size" else int(value) if kind == "embedding_size" else value
    model = dict(run["cfg"]["Model"])
    sections = {"Model": dict(model, **{name: value})} if section == "Model" else \
        {"Data": dict(run["cfg"]["Data"], **{name: value})}
    cfg = config(run["data"], str(tmp_path / "out"), Global={"checkpoint": run["ckpt"]},
                 Loss={"sub_centers": 2}, **sections)
    with pytest.raises(ConfigError) as info:
        Trainer(cfg)
    assert str(info.value) == f"checkpoint {run['ckpt']} was trained with {trained}: add {fix}"


def test_resume_names_the_head_differences_the_same_way(run, tmp_path):
    from plsc.train import Trainer
    cfg = config(run["data"], str(tmp_path / "out"), Global={"checkpoint": run["ckpt"]},
                 Loss={"sub_centers": 3})
    with pytest.raises(ConfigError) as info:
        Trainer(cfg)
    assert str(info.value) == (f"checkpoint {run['ckpt']} was trained with Loss.sub_centers=2; "
                               "the config has 3: add -o Loss.sub_centers=2")


# ---------------------------------------------------------------- the strict loader itself

class Small(nn.Layer):
    def __init__(self, width=4):
        super().__init__()
        self.fc = nn.Linear(3, width)
        self.bn = nn.BatchNorm1D(width)


def _values(layer):
    return {k: v.numpy().copy() for k, v in layer.state_dict().items()}


def test_strict_loader_with_missing_extra_and_mis_shaped_keys():
    """Each bad state is refused with the message written here by hand, and the layer is left
    as it was; the exact state loads every value."""
    from plsc.loading import load_strict
    paddle.seed(0)
    layer = Small()
    before = _values(layer)
    source = {k: np.full(v.shape, 7.0, v.dtype) for k, v in before.items()}
    keys = list(before)  # fc.weight, fc.bias, bn.weight, bn.bias, bn._mean, bn._variance
    assert keys == ["fc.weight", "fc.bias", "bn.weight", "bn.bias", "bn._mean", "bn._variance"]
    tail = "; nothing loaded (check Model.name, Model.embedding_size and Data.image_size)"
    cases = {
        "missing": ({k: v for k, v in source.items() if k != "bn._mean"},
                    "f does not fit the model: missing bn._mean"),
        "extra": (dict(source, **{"head.weight": np.zeros((2, 2), np.float32)}),
                  "f does not fit the model: unexpected head.weight"),
        "shape": (dict(source, **{"fc.weight": np.zeros((3, 5), np.float32)}),
                  "f does not fit the model: fc.weight has shape [3, 5], the model's is [3, 4]"),
        "two shapes": (dict(source, **{"fc.bias": np.zeros(5, np.float32),
                                       "bn._variance": np.zeros(2, np.float32)}),
                       "f does not fit the model: fc.bias has shape [5], the model's is [4] "
                       "(and 1 more tensors of another shape)"),
        "all three": ({**{k: v for k, v in source.items() if k not in ("fc.bias", "bn.bias")},
                       "bn.weight": np.zeros(1, np.float32), "x": np.zeros(1, np.float32)},
                      "f does not fit the model: bn.weight has shape [1], the model's is [4]; "
                      "missing fc.bias, bn.bias; unexpected x"),
    }
    for name, (state, message) in cases.items():
        with pytest.raises(ConfigError) as info:
            load_strict(layer, {k: paddle.to_tensor(v) for k, v in state.items()}, "f")
        assert str(info.value) == message + tail, name
        after = _values(layer)
        assert all(np.array_equal(after[k], v) for k, v in before.items()), name
    load_strict(layer, {k: paddle.to_tensor(v) for k, v in source.items()}, "f")
    assert all(np.array_equal(v, source[k]) for k, v in _values(layer).items())


def test_strict_loader_names_the_first_few_of_many_keys():
    from plsc.loading import load_strict
    with pytest.raises(ConfigError) as info:
        load_strict(Small(), {}, "empty.pdparams")
    assert str(info.value).startswith("empty.pdparams does not fit the model: missing fc.weight, "
                                      "fc.bias, bn.weight and 3 more;")


# Every set_state_dict (or Paddle's aliases set_dict / load_dict) called in plsc, by file and
# receiver: a Layer's only in the strict loader; the others are optimizers, schedulers and
# plsc's own small state holders, which Paddle's Layer loading does not concern.
ALLOWED_CALLS = {
    ("plsc/loading.py", "layer"),  # the strict loader, after its check
    ("plsc/train/checkpointing.py", "self.backbone_opt"),  # an optimizer
    ("plsc/train/checkpointing.py", "self.lr"),  # the learning-rate schedule
    ("plsc/train/checkpointing.py", "self.scaler"),  # plsc.train.amp's loss scaler
    ("plsc/train/checkpointing.py", "self.nonfinite"),  # plsc.train.divergence's counter
    ("plsc/train/checkpointing.py", "self.head_opt"),  # the head's sparse-row optimizer
}


def test_no_layer_is_loaded_outside_the_strict_loader():
    found = set()
    for path in glob.glob(os.path.join(ROOT, "plsc", "**", "*.py"), recursive=True):
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("set_state_dict", "set_dict", "load_dict")):
                found.add((os.path.relpath(path, ROOT), ast.unparse(node.func.value)))
    assert found == ALLOWED_CALLS
