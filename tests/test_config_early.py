"""Config errors before anything is built: every name a config picks from a registry is checked
at load with a "did you mean" line (exit 2, no output folder, no data), and the data's class
count is compared with Loss.num_classes before the first step."""
import os
import subprocess
import sys
import time

import pytest

from face_folders import write_faces
from plsc.config import ConfigError, load_config, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "tools", "train.py")
DEMO = os.path.join(ROOT, "configs", "demo.yaml")
MINIMAL = {"Loss": {"num_classes": 10}, "Data": {"root": "/data"}}


def with_(section, key, value):
    raw = {sec: dict(keys) for sec, keys in MINIMAL.items()}
    raw.setdefault(section, {})[key] = value
    return raw


# (section, key, mistyped value, the name a user meant): written by hand from the registries
@pytest.mark.parametrize("section,key,typed,meant", [
    ("Model", "name", "IResNet51", "IResNet50"),
    ("Model", "name", "iresnet_tiny", "IResNetTiny"),
    ("Model", "name", "r10", "IResNet100"),  # an arcface_torch alias: its canonical name
    ("Loss", "margin", "arcfce", "arcface"),
    ("Optimizer", "name", "sdg", "sgd"),
    ("LRScheduler", "name", "cosin", "cosine"),
    ("Data", "dataset", "recordoi", "recordio"),
])
def test_registry_names_mistyped_at_load(section, key, typed, meant):
    with pytest.raises(ConfigError) as err:
        validate(with_(section, key, typed))
    message = str(err.value)
    assert f"{section}.{key}" in message and repr(typed) in message, message
    assert f"did you mean {meant!r}?" in message and "\n" not in message, message


@pytest.mark.parametrize("name", ["IResNet50", "iresnet50", "r50", "R100", "mbf", "ViTDemo"])
def test_registry_names_and_aliases_pass(name):
    assert validate(with_("Model", "name", name))["Model"]["name"] == name


def test_kernel_set_mistyped_at_load(monkeypatch):
    monkeypatch.setenv("PLSC_KERNELS", "devise")
    with pytest.raises(ConfigError, match=r"PLSC_KERNELS='devise'.*did you mean 'device'\?"):
        validate(MINIMAL)
    monkeypatch.setenv("PLSC_KERNELS", "device")
    validate(MINIMAL)


def test_the_config_reads_the_names_without_paddle():
    code = "import sys, plsc.config; print('paddle' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


def test_mistyped_model_exits_before_the_output_folder_or_data(tmp_path):
    out, data = tmp_path / "out", tmp_path / "data"
    start = time.time()
    done = subprocess.run([sys.executable, TRAIN, "-c", DEMO, "-o", "Model.name=IResNet51",
                           "-o", f"Global.output_dir={out}", "-o", f"Data.root={data}",
                           "-o", f"Eval.root={data}"],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    seconds = time.time() - start
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and seconds < 10, (seconds, done.stderr)
    assert len(errors) == 1 and "did you mean 'IResNet50'?" in errors[0], done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert not out.exists() and not data.exists()
    assert sorted(os.listdir(tmp_path)) == []


# -- the data's class count against Loss.num_classes --------------------------------------

TINY = ["-o", "Global.max_steps=1", "-o", "Model.name=IResNetTiny", "-o", "Model.embedding_size=16",
        "-o", "Data.image_size=[16, 16]", "-o", "Data.batch_size=4", "-o", "Eval.targets=[]",
        "-o", "Logging.visualdl=false", "-o", "Logging.progress_bar=false"]


def train(tmp_path, *overrides):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, TRAIN, "-c", DEMO, "-o", f"Global.output_dir={out}",
                           *TINY, *overrides], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=300)
    log = out / "train.log"
    return done, done.stdout + done.stderr, log.read_text() if log.exists() else ""


def assert_refused_before_step(tmp_path, done, text, log, configured, in_data):
    """Status 2 with one line naming both class counts and the -o that fits, no step taken, and
    train.log (when the run opened it) ending with the same reason."""
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, text
    assert f"Loss.num_classes={configured}" in errors[0] and f"{in_data} classes" in errors[0], errors
    assert f"-o Loss.num_classes={in_data}" in errors[0] and "Traceback" not in text
    assert "step 1" not in text + log and not (tmp_path / "out" / "checkpoints").exists()
    assert log.splitlines()[-1].endswith(f"the run did not start: {errors[0][len('error: '):]}"), log


def test_synthetic_classes_above_num_classes_stop_before_generating(tmp_path):
    data = tmp_path / "data"
    done, text, log = train(tmp_path, "-o", f"Data.root={data}", "-o", "Loss.num_classes=10",
                            "-o", "Data.synthetic={num_identities: 20, images_per_identity: 2, "
                                  "num_val_identities: 4, num_pairs: 10}")
    assert_refused_before_step(tmp_path, done, text, log, configured=10, in_data=20)
    assert not data.exists(), "generated anyway"


def test_a_folder_with_more_classes_stops_before_the_first_step(tmp_path):
    faces = write_faces(tmp_path / "faces", identities=6, per_identity=2, size=16)
    done, text, log = train(tmp_path, "-o", "Data.dataset=folder", "-o", f"Data.root={faces}",
                            "-o", "Loss.num_classes=4")
    assert_refused_before_step(tmp_path, done, text, log, configured=4, in_data=6)


def test_fewer_classes_in_the_data_are_one_warning_line(tmp_path):
    faces = write_faces(tmp_path / "faces", identities=6, per_identity=2, size=16)
    done, text, log = train(tmp_path, "-o", "Data.dataset=folder", "-o", f"Data.root={faces}",
                            "-o", "Loss.num_classes=9")
    assert done.returncode == 0, text
    warnings = [line for line in log.splitlines() if "warning:" in line]
    assert len(warnings) == 1, log
    assert "Loss.num_classes=9" in warnings[0] and "6 classes" in warnings[0], warnings
    assert "3 classes get no samples" in warnings[0] and "step 1/1" in log


def test_a_list_counts_its_largest_label_and_the_property_file_its_first_field(tmp_path):
    from plsc.data import ImageListDataset, RecordIODataset
    from plsc.train.builders import class_count_note
    (tmp_path / "list.txt").write_text("a.jpg 0\nb.jpg 7\nc.jpg 2\n")
    listed = ImageListDataset(str(tmp_path / "list.txt"))
    assert listed.data_classes == 8
    with pytest.raises(ConfigError, match=r"Loss.num_classes=5 is below the training data's 8 "
                                          r"classes .*; set -o Loss.num_classes=8"):
        class_count_note(5, listed.data_classes, "the list")
    assert class_count_note(8, 8, "the list") is None
    assert "Loss.num_classes=11" in class_count_note(11, 8, "the list")
    assert class_count_note(3, None, "a rec without property") is None  # unknown: no check
    from trainer_common import CLASSES, make_data
    root = make_data(str(tmp_path / "rec"))
    assert RecordIODataset(root).data_classes == CLASSES  # the generator's count
    (tmp_path / "rec" / "property").write_text("31,16,16\n")
    assert RecordIODataset(root).data_classes == 31


def test_unknown_synthetic_argument_at_start(tmp_path):
    from plsc.train.builders import build_train_dataset
    cfg = load_config(DEMO, [f"Data.root={tmp_path / 'data'}", "Data.synthetic={num_identity: 20}"])
    with pytest.raises(ConfigError, match=r"Data.synthetic: unknown argument 'num_identity'; "
                                          r"did you mean 'num_identities'\?"):
        build_train_dataset(cfg)
    assert not (tmp_path / "data").exists()
