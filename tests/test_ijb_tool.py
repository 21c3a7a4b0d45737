"""tools/eval_ijb.py and plsc.apps.ijb on a small synthetic IJB layout: result files, the
features round trip, options, errors, two launched ranks against one process, and the
training log's ROC image."""
import json
import os

import cv2
import numpy as np
import paddle
import pytest

import scripts
from trainer_common import config
from ijb_layout import make_layout
from plsc.config import dump_config
from plsc.data import DataError, FaceTransform, align_face
from plsc.parts import build_backbone
from plsc.apps.ijb import evaluate_ijb
from plsc.metrics import ijb_report

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(os.path.dirname(HERE), "tools", "eval_ijb.py")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The layout, a freshly initialised IResNetTiny saved as .pdparams, its config (+ YAML)."""
    base = tmp_path_factory.mktemp("ijb_tool")
    root = str(base / "IJB_release" / "IJBC")
    ref = make_layout(root, num_identities=6, templates_per_identity=3)
    cfg = config(str(base / "unused"), str(base / "out"), Eval={"batch_size": 16})
    paddle.seed(0)
    model = build_backbone(cfg)
    weights = str(base / "backbone.pdparams")
    paddle.save(model.state_dict(), weights)
    cfg["Global"]["pretrained"] = weights
    path = str(base / "config.yaml")
    with open(path, "w") as f:
        f.write(dump_config(cfg))
    model.eval()
    return {"root": root, "ref": ref, "cfg": cfg, "yaml": path, "model": model, "base": base}


@pytest.fixture(scope="module")
def single(setup):
    """One in-process run with --save-features and VisualDL."""
    cfg = dict(setup["cfg"], Logging={"visualdl": True, "progress_bar": False})
    feats = str(setup["base"] / "single_feats.npy")
    result = evaluate_ijb(cfg, setup["root"], "IJBC", save_features=feats, progress=False)
    return {"result": result, "features": feats, "out": cfg["Global"]["output_dir"]}


def _tool_main(argv):
    return scripts.load(TOOL).main(argv)


def test_features_are_the_flip_summed_embeddings_of_aligned_faces(setup, single):
    ref, model = setup["ref"], setup["model"]
    feats = np.load(single["features"])
    assert feats.shape == (len(ref["names"]), 32) and feats.dtype == np.float32
    transform = FaceTransform((16, 16), train=False)
    for i in (0, 5, len(feats) - 1):
        raw = cv2.cvtColor(cv2.imread(os.path.join(setup["root"], "loose_crop", ref["names"][i])),
                           cv2.COLOR_BGR2RGB)
        face = align_face(raw, ref["landmarks"][i], (16, 16))
        x = np.stack([transform.apply(face), transform.apply(face, flip=True)])
        expect = model(paddle.to_tensor(x)).numpy().sum(0)
        np.testing.assert_allclose(feats[i], expect, rtol=1e-5, atol=1e-5)


def test_result_files(setup, single):
    ref, result, out = setup["ref"], single["result"], single["out"]
    saved = json.load(open(os.path.join(out, "ijbc_result.json")))
    assert saved["target"] == "IJBC" and saved["num_images"] == len(ref["names"])
    assert saved["num_templates"] == 18 and saved["num_pairs"] == len(ref["labels"])
    assert list(saved["tar_at_far"]) == ["1e-06", "1e-05", "0.0001", "0.001", "0.01", "0.1"]
    assert all(0.0 <= v <= 1.0 for v in saved["tar_at_far"].values()) and 0.0 <= saved["auc"] <= 1.0
    assert saved == {k: v for k, v in result.items() if k not in ("scores", "far", "tar")}
    expect = ijb_report(np.load(single["features"]), ref["templates"], ref["medias"], ref["pairs"],
                        ref["labels"], ref["det_scores"])
    np.testing.assert_allclose(np.load(os.path.join(out, "ijbc_scores.npy")), expect["scores"], atol=1e-6)
    assert saved["tar_at_far"] == pytest.approx({str(k): v for k, v in expect["tar_at_far"].items()}, abs=1e-6)
    assert saved["auc"] == pytest.approx(expect["auc"], abs=1e-6)
    assert cv2.imread(os.path.join(out, "ijbc_roc.png")) is not None
    from visualdl import LogReader
    logs = [os.path.join(out, "vdl", f) for f in os.listdir(os.path.join(out, "vdl"))]
    tags = LogReader(file_path=logs[0]).get_tags()
    assert "ijb/ijbc/roc" in tags.get("image", []) and "ijb/ijbc/auc" in tags.get("scalar", [])
    assert "ijb/ijbc/tar_at_far_0.0001" in tags["scalar"]


def test_features_file_reproduces_the_result_through_the_tool(setup, single, tmp_path, capsys):
    code = _tool_main(["-c", setup["yaml"], "--root", setup["root"], "--target", "ijbc",
                       "--features", single["features"], "-o", f"Global.output_dir={tmp_path}"])
    assert code == 0
    text = capsys.readouterr().out
    assert "IJBC: " in text and "1e-06" in text and "AUC" in text
    saved = json.load(open(tmp_path / "ijbc_result.json"))
    assert saved == json.load(open(os.path.join(single["out"], "ijbc_result.json")))
    np.testing.assert_array_equal(np.load(tmp_path / "ijbc_scores.npy"), single["result"]["scores"])


def test_options_turn_off_weighting_and_normalise_images(setup, single, tmp_path):
    code = _tool_main(["-c", setup["yaml"], "--root", setup["root"], "--target", "IJBC",
                       "--features", single["features"], "--no-detector-score", "--normalize-images",
                       "-o", f"Global.output_dir={tmp_path}"])
    assert code == 0
    saved = json.load(open(tmp_path / "ijbc_result.json"))
    assert saved["detector_score"] is False and saved["normalize_images"] is True
    ref = setup["ref"]
    expect = ijb_report(np.load(single["features"]), ref["templates"], ref["medias"], ref["pairs"],
                        ref["labels"], None, normalize_images=True)
    np.testing.assert_allclose(np.load(tmp_path / "ijbc_scores.npy"), expect["scores"], atol=1e-9)
    assert np.abs(expect["scores"] - single["result"]["scores"]).max() > 1e-4


def test_bad_features_file_and_bad_layout_fail_in_one_line(setup, tmp_path, capsys):
    bad = str(tmp_path / "bad.npy")
    np.save(bad, np.zeros((5, 32), np.float32))
    args = ["-c", setup["yaml"], "--root", setup["root"], "--target", "IJBC",
            "-o", f"Global.output_dir={tmp_path}"]
    assert _tool_main(args + ["--features", bad]) == 65  # a bad data file: EX_DATAERR
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}: features of shape (5, 32)") and "ijbc_name_5pts_score.txt" in err
    assert _tool_main(args[:3] + [str(tmp_path / "nowhere")] + args[4:]) == 2
    assert "ijbc_face_tid_mid.txt does not exist" in capsys.readouterr().err
    with pytest.raises(DataError, match="features of shape"):
        evaluate_ijb(setup["cfg"], setup["root"], "IJBC", features=bad)


def test_two_launched_ranks_give_the_features_of_one_process(setup, single, tmp_path, run_ranks):
    out = tmp_path / "launched"
    feats = str(tmp_path / "feats2.npy")
    done = run_ranks(TOOL, 2, ["-c", setup["yaml"], "--root", setup["root"], "--target", "IJBC",
                               "--save-features", feats, "-o", f"Global.output_dir={out}",
                               "-o", "Data.num_workers=1", "-o", "Eval.batch_size=8"],
                     cwd=str(tmp_path))
    assert done.status == 0, done.tail(4000)
    logs = "".join(done.logs)
    np.testing.assert_allclose(np.load(feats), np.load(single["features"]), rtol=1e-5, atol=1e-5)
    saved = json.load(open(out / "ijbc_result.json"))
    assert saved["num_images"] == single["result"]["num_images"]
    assert saved["auc"] == pytest.approx(single["result"]["auc"], abs=1e-4)
    assert "TAR (%)" in logs  # rank 0 printed the table


def test_undecodable_image_in_one_ranks_share_stops_both(setup, tmp_path, run_ranks):
    """The last image (rank 1's share) is text: both ranks end with status 65, rank 1 naming the
    image, rank 0 naming rank 1; SIGKILLed after 120 s so that a hang fails here."""
    import shutil
    root = str(tmp_path / "IJBC")
    shutil.copytree(setup["root"], root)
    with open(os.path.join(root, "meta", "ijbc_name_5pts_score.txt")) as f:
        last = f.read().split("\n")[-2].split()[0]
    with open(os.path.join(root, "loose_crop", last), "wb") as f:
        f.write(b"not a face")
    done = run_ranks(TOOL, 2, ["-c", setup["yaml"], "--root", root, "--target", "IJBC",
                               "-o", f"Global.output_dir={tmp_path / 'out'}",
                               "-o", "Data.num_workers=1", "-o", "Eval.batch_size=8"],
                     cwd=str(tmp_path), timeout=120)
    texts = done.logs
    assert done.status == 65, done.tail(2000)
    lines = [[line for line in t.splitlines() if line.startswith("error:")] for t in texts]
    assert len(lines[1]) == 1 and last in lines[1][0] and "cannot decode" in lines[1][0], texts[1]
    assert lines[0] == ["error: rank 0: rank 1 stopped on a data error while loading its share of "
                        "the images (its log names the file or record); exiting"], texts[0]


def test_training_log_writes_the_roc_image(tmp_path):
    from visualdl import LogReader
    from plsc.train.logger import TrainLogger
    log = TrainLogger(str(tmp_path), total_steps=10, interval=5, visualdl=True, progress_bar=False)
    report = {"accuracy": 0.9, "accuracy_std": 0.01, "threshold": 1.2, "embedding_norm": 10.0,
              "tar_at_far": {0.01: 0.8}, "far": np.array([0.0, 0.1, 1.0]), "tar": np.array([0.0, 0.7, 1.0])}
    log.evaluation(4, "val", report)
    log.close()
    files = os.listdir(tmp_path / "vdl")
    tags = LogReader(file_path=os.path.join(tmp_path, "vdl", files[0])).get_tags()
    assert "eval/val/roc" in tags["image"] and "eval/val/accuracy" in tags["scalar"]


def test_training_verification_logs_its_roc_image(tmp_path):
    from visualdl import LogReader
    from trainer_common import make_data
    from plsc.train import Trainer
    data = make_data(str(tmp_path / "data"))
    cfg = config(data, str(tmp_path / "run"), Global={"max_steps": 2},
                 Eval={"root": data, "targets": ["val"], "interval": 2, "batch_size": 16},
                 Logging={"visualdl": True, "progress_bar": False})
    trainer = Trainer(cfg)
    trainer.train()
    trainer.log.close()
    vdl = tmp_path / "run" / "vdl"
    tags = LogReader(file_path=os.path.join(vdl, os.listdir(vdl)[0])).get_tags()
    assert "eval/val/roc" in tags["image"] and "eval/val/accuracy" in tags["scalar"]
