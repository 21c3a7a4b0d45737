"""`--onnx FILE` of tools/eval.py, tools/extract.py and tools/eval_ijb.py: an IResNetTiny exported
by paddle2onnx gives, through onnxruntime, the embeddings of the same weights run in Paddle and
the same verification accuracy, extraction and IJB TAR@FAR; the input conventions (RGB/BGR,
normalised/0..255) are converted to what the file expects; a fixed batch dimension is fed
image by image; without onnxruntime, --onnx is a one-line error."""
import os
import sys

import numpy as np
import paddle
import pytest

import scripts
from trainer_common import IMAGE, config, make_data
from ijb_layout import make_layout
from oracles import rel_err
from plsc.config import dump_config
from plsc.parts import build_backbone

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(os.path.dirname(HERE), "tools")

# Embeddings within 1e-4 of Paddle's, relative to their scale (the acceptance). Both run
# float32 convolutions and GEMMs, summed in different orders (onnxruntime's MLAS, Paddle's
# oneDNN/MKL; paddle2onnx folds nothing here but may reorder), so they differ by a few 2^-24
# (6e-8) times the magnitude of the terms summed, times the depth: ~1e-6 measured. A wrong input
# convention (channels swapped, 0..255 fed to a normalising file) moves them by more than 1e-2,
# which test_wrong_convention_is_far_outside_the_tolerance checks.
EMB_TOL = 1e-4
ACC_TOL = 1e-3  # accuracy and TAR (the acceptance): one pair of 40 is 0.025


def _tool(name):
    return scripts.load(f"tools/{name}.py").main


def _with_input(src, dst, new_name, prefix_nodes):
    """Copy the ONNX file `src` to `dst` with a new graph input `new_name` that goes through
    `prefix_nodes(new_name, old_name)` (a list of (node, initializers)) into the old input."""
    import onnx
    from onnx import helper
    model = onnx.load(src)
    graph = model.graph
    old = graph.input[0]
    new = helper.make_tensor_value_info(new_name, old.type.tensor_type.elem_type,
                                        [d.dim_param or d.dim_value for d in old.type.tensor_type.shape.dim])
    nodes, inits = prefix_nodes(new_name, old.name)
    graph.input.remove(old)
    graph.input.insert(0, new)
    graph.initializer.extend(inits)
    for node in reversed(nodes):
        graph.node.insert(0, node)
    onnx.checker.check_model(model)
    onnx.save(model, dst)
    return dst


def _bgr_file(src, dst):
    """A file that takes BGR images (insightface-style input name 'input.1') and reverses the
    channels itself before the RGB network: fed BGR, it must equal the RGB network."""
    from onnx import TensorProto, helper

    def prefix(new, old):
        idx = helper.make_tensor("bgr_to_rgb", TensorProto.INT64, [3], [2, 1, 0])
        return [helper.make_node("Gather", [new, "bgr_to_rgb"], [old], axis=1)], [idx]
    return _with_input(src, dst, "input.1", prefix)


def _pixels_file(src, dst):
    """A file that takes 0..255 pixel values and normalises them itself (Sub, then Mul, as the
    MXNet-converted insightface files begin)."""
    from onnx import TensorProto, helper

    def prefix(new, old):
        mean = helper.make_tensor("mean", TensorProto.FLOAT, [], [127.5])
        scale = helper.make_tensor("scale", TensorProto.FLOAT, [], [1 / 127.5])
        return [helper.make_node("Sub", [new, "mean"], ["centred"]),
                helper.make_node("Mul", ["centred", "scale"], [old])], [mean, scale]
    return _with_input(src, dst, "data", prefix)


def _fixed_batch_file(src, dst, batch=1):
    """The file with its input's batch dimension fixed to `batch` (as some model-zoo files)."""
    import onnx
    model = onnx.load(src)
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    dim.ClearField("dim_param")
    dim.dim_value = batch
    onnx.save(model, dst)
    return dst


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """An IResNetTiny (random weights, random BatchNorm statistics) as .pdparams and as ONNX
    (paddle2onnx through plsc's export), the variant files, the synthetic set and pack, an IJB
    layout, and a config (+ YAML) whose Data.image_size is not the file's."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("paddle2onnx")
    pytest.importorskip("onnx")
    from plsc.apps.export import export_backbone
    base = tmp_path_factory.mktemp("onnx_eval")
    data = make_data(str(base / "data"))
    ijb_root = str(base / "IJB_release" / "IJBC")
    # strength 1.2 (the layout's default is 0.6): faces varied enough that this random backbone's
    # TARs lie strictly between 0 and 1, so a changed score can move them
    make_layout(ijb_root, num_identities=6, templates_per_identity=3, strength=1.2)
    cfg = config(data, str(base / "out"), Eval={"root": data, "targets": ["val"], "batch_size": 16})
    paddle.seed(0)  # a seed whose random backbone is better than chance on the pack (0.7)
    model = build_backbone(cfg)
    rng = np.random.RandomState(0)
    for name, buf in model.state_dict().items():  # BatchNorm statistics away from (0, 1)
        if name.endswith("._mean"):
            buf.set_value(rng.normal(0, 0.1, buf.shape).astype("float32"))
        elif name.endswith("._variance"):
            buf.set_value(rng.uniform(0.5, 1.5, buf.shape).astype("float32"))
    model.eval()
    weights = str(base / "backbone.pdparams")
    paddle.save(model.state_dict(), weights)
    onnx_file = export_backbone(model, (IMAGE, IMAGE), str(base / "export"))["onnx"]
    files = {"rgb": onnx_file,
             "bgr": _bgr_file(onnx_file, str(base / "bgr.onnx")),
             "rgb255": _pixels_file(onnx_file, str(base / "pixels.onnx")),
             "batch1": _fixed_batch_file(onnx_file, str(base / "batch1.onnx"))}
    paddle_cfg = dict(cfg, Global=dict(cfg["Global"], pretrained=weights))
    # The ONNX runs' config: no weights, and an image size the file must replace.
    onnx_cfg = dict(cfg, Data=dict(cfg["Data"], image_size=[2 * IMAGE, 2 * IMAGE]))
    path = str(base / "onnx_config.yaml")
    with open(path, "w") as f:
        f.write(dump_config(onnx_cfg))
    return {"base": base, "data": data, "ijb": ijb_root, "model": model, "files": files,
            "paddle_cfg": paddle_cfg, "onnx_cfg": onnx_cfg, "yaml": path}


def _paddle_embeddings(model, x):
    with paddle.no_grad():
        return model(paddle.to_tensor(np.ascontiguousarray(x))).numpy()


def _pack(setup):
    from plsc.data import load_verification_arrays
    return load_verification_arrays(os.path.join(setup["data"], "val.bin"), (IMAGE, IMAGE))


@pytest.mark.parametrize("convention,file", [("rgb", "rgb"), ("bgr", "bgr"), ("rgb255", "rgb255"),
                                             ("rgb", "batch1")])
def test_embeddings_match_paddle(setup, convention, file):
    """The verification embeddings (image and flip, as the evaluator takes them) of each file
    fed in its convention equal the Paddle backbone's on the same normalised RGB arrays."""
    from plsc.apps.onnx_backbone import onnx_backbone
    from plsc.embedding import extract_embeddings
    data, _ = _pack(setup)
    cfg, model = onnx_backbone(setup["onnx_cfg"], setup["files"][file], convention)
    assert cfg["Data"]["image_size"] == [IMAGE, IMAGE]  # read from the file, not the config's 32
    assert model.batch == (1 if file == "batch1" else None)
    emb, flipped = extract_embeddings(model, data, 16)
    expect = _paddle_embeddings(setup["model"], data)
    expect_flipped = _paddle_embeddings(setup["model"], data[..., ::-1])
    err = max(rel_err(emb, expect), rel_err(flipped, expect_flipped))
    print(f"{file} ({convention}): relative error {err:.2e}")
    assert err <= EMB_TOL


def test_wrong_convention_is_far_outside_the_tolerance(setup):
    """Feeding a file the other convention moves the embeddings by far more than EMB_TOL, so the
    tolerance would catch a missing or wrong conversion."""
    from plsc.apps.onnx_backbone import OnnxBackbone
    data = _pack(setup)[0][:32]
    expect = _paddle_embeddings(setup["model"], data)
    for file, wrong in (("bgr", "rgb"), ("rgb", "bgr"), ("rgb255", "rgb"), ("rgb", "rgb255")):
        got = OnnxBackbone(setup["files"][file], wrong).embed(data)
        assert rel_err(got, expect) > 1e-2, (file, wrong)


def test_eval_tool_with_onnx_gives_paddles_accuracy(setup, capsys):
    """tools/eval.py --onnx with a config without weights (and another image size) reports the
    accuracy of the Paddle run of the same weights and of an independent computation."""
    from plsc.apps.tasks import evaluate
    from test_tasks import pack_accuracies
    paddle_report = evaluate(setup["paddle_cfg"], out=open(os.devnull, "w"))["val"]
    out = setup["base"] / "eval_onnx"
    code = _tool("eval")(["-c", setup["yaml"], "--onnx", setup["files"]["rgb"],
                          "-o", f"Global.output_dir={out}"])
    text, err = capsys.readouterr()
    assert code == 0, text + err
    assert f"images of {IMAGE}x{IMAGE}, the input size of {setup['files']['rgb']}" in err
    row = next(line.split() for line in text.splitlines() if line.startswith("val "))
    acc, norm, tars = float(row[1]), float(row[5]), [float(v) for v in row[6:9]]
    print(f"accuracy: onnx {acc:.4f}, paddle {paddle_report['accuracy']:.4f}")
    assert paddle_report["accuracy"] >= 0.6  # not chance: a wrong embedding would change it
    assert abs(acc - paddle_report["accuracy"]) <= ACC_TOL
    for got, far in zip(tars, (1e-2, 1e-3, 1e-4)):  # printed to 4 places
        assert abs(got - paddle_report["tar_at_far"][far]) <= ACC_TOL
    assert min(abs(acc - a) for a in pack_accuracies(setup["model"], os.path.join(setup["data"], "val.bin"))) <= ACC_TOL
    assert norm == pytest.approx(paddle_report["embedding_norm"], rel=EMB_TOL, abs=0.006)  # printed to 2 places
    assert os.path.getsize(out / "roc.png") > 1000


def test_extract_tool_with_onnx_writes_paddles_embeddings(setup, capsys):
    """tools/extract.py --onnx (the batch-1 file, a batch size of 16, --flip) writes the .npy of
    the Paddle extraction and the embeddings of the Paddle backbone on the decoded images."""
    from plsc.apps.tasks import extract
    from plsc.data import RecordIODataset
    base = setup["base"]
    paddle_out, _ = extract(setup["paddle_cfg"], setup["data"], str(base / "paddle_emb.npy"), flip=True)
    code = _tool("extract")(["-c", setup["yaml"], "--onnx", setup["files"]["batch1"], "--input", setup["data"],
                             "--output", str(base / "onnx_emb.npy"), "--flip", "--batch-size", "16"])
    assert code == 0, capsys.readouterr().err
    emb = np.load(base / "onnx_emb.npy")
    np.testing.assert_array_equal(np.load(base / "onnx_emb_labels.npy"), np.load(base / "paddle_emb_labels.npy"))
    err_tool = rel_err(emb, np.load(paddle_out))
    ds = RecordIODataset(setup["data"], image_size=(IMAGE, IMAGE), train=False)
    x = np.stack([ds[i][0] for i in range(len(ds))])
    expect = _paddle_embeddings(setup["model"], x) + _paddle_embeddings(setup["model"], x[..., ::-1])
    err_model = rel_err(emb, expect)
    print(f"extract: relative error {err_tool:.2e} against the Paddle .npy, {err_model:.2e} against the model")
    assert emb.shape == (len(ds), 32) and max(err_tool, err_model) <= EMB_TOL


@pytest.fixture(scope="module")
def ijb_paddle(setup):
    """The Paddle run of the IJB layout: its result and its features file."""
    from plsc.apps.ijb import evaluate_ijb
    base = setup["base"]
    feats = str(base / "ijb_paddle.npy")
    cfg = dict(setup["paddle_cfg"], Global=dict(setup["paddle_cfg"]["Global"], output_dir=str(base / "ijb_paddle")))
    result = evaluate_ijb(cfg, setup["ijb"], "IJBC", save_features=feats, progress=False, out=open(os.devnull, "w"))
    assert 0 < result["tar_at_far"]["0.01"] < 1 and 0.6 < result["auc"] < 1  # not a degenerate ROC
    return {"result": result, "features": feats}


def _compare_ijb(out_dir, feats, ijb_paddle, what):
    import json
    ref = ijb_paddle["result"]
    err = rel_err(np.load(feats), np.load(ijb_paddle["features"]))
    got = json.load(open(os.path.join(out_dir, "ijbc_result.json")))
    delta = max(abs(got["tar_at_far"][k] - ref["tar_at_far"][k]) for k in ref["tar_at_far"])
    print(f"IJB {what}: features relative error {err:.2e}, max |dTAR| {delta:.2e}, "
          f"|dAUC| {abs(got['auc'] - ref['auc']):.2e}")
    assert got["num_images"] == ref["num_images"]
    assert err <= EMB_TOL and delta <= ACC_TOL and abs(got["auc"] - ref["auc"]) <= ACC_TOL


def test_ijb_with_onnx_gives_paddles_tar_at_far(setup, ijb_paddle, capsys):
    """tools/eval_ijb.py --onnx (the BGR file, --onnx-input bgr: the IJB path feeds Paddle tensors
    normalised on the device) gives the Paddle run's features, TAR@FAR and AUC."""
    out, feats = setup["base"] / "ijb_onnx", str(setup["base"] / "ijb_onnx.npy")
    code = _tool("eval_ijb")(["-c", setup["yaml"], "--root", setup["ijb"], "--target", "IJBC",
                              "--onnx", setup["files"]["bgr"], "--onnx-input", "bgr",
                              "--save-features", feats, "-o", f"Global.output_dir={out}"])
    assert code == 0, capsys.readouterr().err
    _compare_ijb(out, feats, ijb_paddle, "one process")


def test_two_launched_ranks_each_run_a_session(setup, ijb_paddle, tmp_path, run_ranks):
    """Two ranks, each with its own session of the batch-1 file over its share of the images:
    the gathered features (both shares) and the TARs are the single Paddle process's."""
    out, feats = tmp_path / "out", str(tmp_path / "feats.npy")
    done = run_ranks(os.path.join(TOOLS, "eval_ijb.py"), 2,
                     ["-c", setup["yaml"], "--root", setup["ijb"], "--target", "IJBC",
                      "--onnx", setup["files"]["batch1"], "--save-features", feats,
                      "-o", f"Global.output_dir={out}", "-o", "Eval.batch_size=8"],
                     cwd=str(tmp_path))
    assert done.status == 0, done.tail(4000)
    assert all(done.logs) and "TAR (%)" in "".join(done.logs)
    _compare_ijb(out, feats, ijb_paddle, "two ranks")


def test_session_threads_are_the_ranks_share(setup, monkeypatch):
    """Two ranks on this node: each session gets half the usable cores (at least 1), as Paddle
    does; Global.cpu_threads overrides it."""
    from plsc.apps.onnx_backbone import onnx_backbone
    from plsc.process.runtime import usable_cores
    monkeypatch.setenv("PADDLE_LOCAL_SIZE", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _, model = onnx_backbone(setup["onnx_cfg"], setup["files"]["rgb"])
    assert model.session.get_session_options().intra_op_num_threads == max(1, usable_cores() // 2)
    cfg = dict(setup["onnx_cfg"], Global=dict(setup["onnx_cfg"]["Global"], cpu_threads=3))
    _, model = onnx_backbone(cfg, setup["files"]["rgb"])
    assert model.session.get_session_options().intra_op_num_threads == 3


def test_onnx_errors_are_one_line(setup, tmp_path, capsys):
    """A missing file (2), a file that is not ONNX (65), --features with --onnx (argparse)."""
    args = ["-c", setup["yaml"], "-o", f"Global.output_dir={tmp_path}"]
    assert _tool("eval")(args + ["--onnx", str(tmp_path / "none.onnx")]) == 2
    assert capsys.readouterr().err.strip() == f"error: ONNX file {tmp_path / 'none.onnx'} does not exist"
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    assert _tool("eval")(args + ["--onnx", str(bad)]) == 65
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {bad}: onnxruntime cannot load it") and "\n" not in err
    with pytest.raises(SystemExit):
        _tool("eval_ijb")(args + ["--root", setup["ijb"], "--target", "IJBC", "--onnx", str(bad),
                                  "--features", str(bad)])
    assert "not allowed with argument" in capsys.readouterr().err


def test_without_onnxruntime_onnx_says_how_to_install(tmp_path, monkeypatch, capsys):
    """Runs whether or not onnxruntime is installed: the import is made to fail."""
    data = make_data(str(tmp_path / "data"))
    path = str(tmp_path / "config.yaml")
    with open(path, "w") as f:
        f.write(dump_config(config(data, str(tmp_path / "out"), Eval={"root": data, "targets": ["val"]})))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    model = tmp_path / "model.onnx"
    model.write_bytes(b"")
    for tool, extra in (("eval", []), ("extract", ["--input", data, "--output", str(tmp_path / "e.npy")])):
        assert _tool(tool)(["-c", path, "--onnx", str(model)] + extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "onnxruntime" in err and 'pip install -e ".[onnx]"' in err, err
