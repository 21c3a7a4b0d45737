"""Config loading, overrides and the errors a user sees."""
import glob
import os

import pytest
import yaml

from plsc.config import ConfigError, load_config, validate

MINIMAL = {"Loss": {"num_classes": 10}, "Data": {"root": "/data"}}


def write(tmp_path, raw):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_yaml_that_does_not_parse_is_one_line_naming_file_and_place(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("Global:\n  max_steps: [1, 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value).startswith(f"{path}: not valid YAML (") and "line 3" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, MINIMAL), ["Eval.targets=[lfw"])
    assert str(err.value).startswith("override 'Eval.targets=[lfw': the value is not valid YAML (")
    assert "\n" not in str(err.value)


def test_defaults_and_typed_overrides(tmp_path):
    path = write(tmp_path, MINIMAL)
    cfg = load_config(path, ["Optimizer.lr=0.05", "Eval.targets=[lfw, cfp_fp]",
                             "Global.max_steps=100", "AMP.enable=true", "Global.checkpoint=null"])
    assert cfg["Optimizer"]["lr"] == 0.05 and cfg["Optimizer"]["momentum"] == 0.9
    assert cfg["Eval"]["targets"] == ["lfw", "cfp_fp"]
    assert cfg["Global"]["max_steps"] == 100 and cfg["AMP"]["enable"] is True
    assert cfg["Global"]["checkpoint"] is None


def test_exponent_numbers_without_a_dot(tmp_path):
    """PyYAML reads `1e-3` as a string (YAML 1.1 wants `1.0e-3`); a number key takes it, in a
    file and in -o alike; an int key and other strings still refuse it."""
    path = tmp_path / "c.yaml"
    path.write_text("Loss: {num_classes: 10}\nData: {root: /data}\nOptimizer: {lr: 1e-3}\n")
    assert yaml.safe_load(path.read_text())["Optimizer"]["lr"] == "1e-3"  # what PyYAML does
    assert load_config(str(path))["Optimizer"]["lr"] == 0.001
    cfg = load_config(str(path), ["Optimizer.lr=5E+2", "Optimizer.weight_decay=-.5e-4"])
    assert cfg["Optimizer"]["lr"] == 500.0 and cfg["Optimizer"]["weight_decay"] == -5e-5
    with pytest.raises(ConfigError, match=r"Global.max_steps must be int, got '1e3' \(str\)"):
        load_config(str(path), ["Global.max_steps=1e3"])
    with pytest.raises(ConfigError, match=r"Optimizer.lr must be number, got '1e' \(str\)"):
        load_config(str(path), ["Optimizer.lr=1e"])


@pytest.mark.parametrize("raw,pattern", [
    ({"Loss": {"num_clases": 3}}, r"unknown key 'Loss.num_clases'; did you mean 'num_classes'\?"),
    ({"Optimzer": {}}, r"unknown section 'Optimzer'; did you mean 'Optimizer'\?"),
    ({"Data": {"batch_size": "64"}}, r"Data.batch_size must be int, got '64' \(str\)"),
    ({"Optimizer": {"lr": True}}, r"Optimizer.lr must be number, got True"),
    ({"AMP": {"enable": 1}}, r"AMP.enable must be true or false, got 1"),
    ({"Loss": {"margin": "arc"}}, r"Loss.margin must be one of arcface, cosface"),
    ({"Loss": {"sample_ratio": 1.5}}, r"Loss.sample_ratio must be in \(0, 1\], got 1.5"),
    ({"Model": {"name": None}}, r"Model.name must not be null"),
])
def test_bad_values_name_the_key(tmp_path, raw, pattern):
    merged = {**MINIMAL, **{k: {**MINIMAL.get(k, {}), **v} for k, v in raw.items()}}
    with pytest.raises(ConfigError, match=pattern):
        load_config(write(tmp_path, merged))


def test_missing_required_and_bad_overrides(tmp_path):
    with pytest.raises(ConfigError, match=r"Loss.num_classes is required"):
        validate({"Data": {"root": "x"}})
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError, match=r"must look like Section.key=value"):
        load_config(path, ["Optimizer.lr"])
    with pytest.raises(ConfigError, match=r"unknown key 'Optimizer.learning_rate'; valid: name, lr, "):
        load_config(path, ["Optimizer.learning_rate=0.1"])
    with pytest.raises(ConfigError, match=r"config file .*nope.yaml does not exist"):
        load_config(str(tmp_path / "nope.yaml"))


def test_shipped_configs_are_valid():
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    for path in glob.glob(os.path.join(root, "*.yaml")):
        load_config(path)
