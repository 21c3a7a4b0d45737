"""Each shipped config named after a published recipe states, in its header, the recipe file
it follows and every value it takes from it; the loaded config (plsc's defaults applied) has
exactly those values.

Header lines (docs/training.md#recipes):

    # recipe: <owner/repo> <path of the recipe's config file>
    # recipe-value: Section.key = <YAML value>  (where the recipe sets it)
    # plsc-differs: Section.key = <YAML value>  (why plsc deliberately differs)

The values were transcribed from the recipes' files, not from plsc; the test compares the two
transcriptions of a config (its header and its body), so a value changed on one side only
fails, and a header that leaves out a setting a recipe fixes fails too.
"""
import os
import re

import pytest
import yaml

from plsc.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE_CONFIGS = ("arcface_r50", "cosface_r100", "glint360k_r100_pfc", "wf42m_vit_t_pfc03",
                  "wf42m_vit_s_pfc03", "wf42m_vit_b_pfc03", "wf42m_vit_l_pfc03",
                  "wf12m_conflict_r50_pfc03_filter04", "adaface_r100")
_LINE = re.compile(r"^# (recipe-value|plsc-differs): (\w+)\.(\w+) = (.+?)  \((.+)\)$")

# What every recipe fixes, so every header must state it (taken from the recipe or differing).
_ALWAYS = ("Model.name", "Model.embedding_size", "Model.bn_unbiased_var", "Loss.margin",
           "Loss.scale", "Loss.num_classes", "Loss.sample_ratio", "Data.batch_size",
           "Optimizer.name", "Optimizer.lr", "Optimizer.base_batch_size",
           "Optimizer.weight_decay", "Optimizer.grad_clip", "Optimizer.grad_allreduce_dtype",
           "LRScheduler.name", "LRScheduler.warmup_epochs", "Global.epochs", "AMP.enable")
_BY_CHOICE = {("Optimizer", "name", "sgd"): ("Optimizer.momentum",),
              ("Optimizer", "name", "adamw"): ("Optimizer.betas",),
              ("LRScheduler", "name", "poly"): ("LRScheduler.power", "LRScheduler.warmup_indexing"),
              ("LRScheduler", "name", "piecewise"): ("LRScheduler.boundaries", "LRScheduler.gamma"),
              ("Loss", "margin", "arcface"): ("Loss.m2", "Loss.straight_through"),
              ("Loss", "margin", "cosface"): ("Loss.m3",),
              ("Loss", "margin", "adaface"): ("Loss.adaface_m", "Loss.adaface_h",
                                              "Loss.adaface_t_alpha")}


def read_header(path):
    """(recipe line, {'Section.key': (kind, value)}) from the comment lines before the YAML."""
    recipe, stated = None, {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            line = line.rstrip("\n")
            if line.startswith("# recipe:"):
                recipe = line.split(":", 1)[1].strip()
            m = _LINE.match(line)
            if line.startswith(("# recipe-value:", "# plsc-differs:")) and not m:
                raise AssertionError(f"{path}: malformed header line {line!r}")
            if m:
                kind, sec, key, value, _source = m.groups()
                name = f"{sec}.{key}"
                assert name not in stated, f"{path}: {name} stated twice"
                stated[name] = (kind, yaml.safe_load(value))
    return recipe, stated


def _path(name):
    return os.path.join(ROOT, "configs", name + ".yaml")


@pytest.mark.parametrize("name", RECIPE_CONFIGS)
def test_recipe_config_has_the_values_its_header_states(name):
    recipe, stated = read_header(_path(name))
    assert recipe and re.match(r"^[\w.-]+/[\w.-]+ \S+\.(py|sh)\b", recipe), \
        f"{name}: no '# recipe: <owner/repo> <file>' line"
    cfg = load_config(_path(name))
    for dotted, (kind, value) in stated.items():
        sec, key = dotted.split(".")
        assert key in cfg[sec], f"{name}: header names {dotted}, not a config key"
        got = cfg[sec][key]
        assert got == value and type(got) is type(value) or (
            isinstance(got, float) and isinstance(value, (int, float)) and got == value), \
            f"{name}: {dotted} is {got!r} in the config, the header ({kind}) states {value!r}"
    needed = set(_ALWAYS)
    for (sec, key, choice), more in _BY_CHOICE.items():
        if cfg[sec][key] == choice:
            needed.update(more)
    missing = sorted(needed - set(stated))
    assert not missing, f"{name}: the header does not state {', '.join(missing)}"


def test_header_parser_reads_values_and_rejects_malformed_lines(tmp_path):
    good = tmp_path / "a.yaml"
    good.write_text("# recipe: a/b c/d.py\n# recipe-value: Optimizer.lr = 0.1  (d.py: lr)\n"
                    "# plsc-differs: Optimizer.base_batch_size = 1024  (scaled)\nGlobal: {}\n")
    assert read_header(str(good)) == ("a/b c/d.py", {
        "Optimizer.lr": ("recipe-value", 0.1),
        "Optimizer.base_batch_size": ("plsc-differs", 1024)})
    bad = tmp_path / "b.yaml"
    bad.write_text("# recipe-value: Optimizer.lr=0.1 (d.py)\nGlobal: {}\n")
    with pytest.raises(AssertionError, match="malformed"):
        read_header(str(bad))
