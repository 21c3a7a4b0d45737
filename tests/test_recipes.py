"""Each shipped config named after a published recipe states, in its header, the recipe file
it follows and every value it takes from it; the loaded config (plsc's defaults applied) has
exactly those values.

Header lines (docs/training.md#recipes):

    # recipe: <owner/repo> <path of the recipe's config file>
    # recipe-trainer: <owner/repo> <the training script> ...
    # recipe-value: Section.key = <YAML value>  (where the recipe sets it)
    # plsc-differs: Section.key = <YAML value>  (why plsc deliberately differs)
    # plsc-differs: <behaviour>  (a difference no config key expresses; BEHAVIOURS)

The values were transcribed from the recipes' files, not from plsc; the test compares the two
transcriptions of a config (its header and its body), so a value changed on one side only
fails, and a header that leaves out a setting a recipe fixes fails too. Beyond what a recipe
file states, TRAINER_FIXES transcribes what the recipe's training script and the libraries it
calls fix whatever the file says (the scaler, clipping, momentum, betas, masking, ...): each
such value that the config does not have must be declared `plsc-differs`, and so must every
behaviour of BEHAVIOURS that applies to the config.
"""
import os
import re

import pytest
import yaml

from plsc.config import load_config
from plsc.models import MODELS, model_options, resolve_name
from plsc.train.amp import build_loss_scaler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE_CONFIGS = ("arcface_r50", "cosface_r100", "glint360k_r100_pfc", "wf42m_vit_t_pfc03",
                  "wf42m_vit_s_pfc03", "wf42m_vit_b_pfc03", "wf42m_vit_l_pfc03",
                  "wf12m_conflict_r50_pfc03_filter04", "adaface_r100")
_LINE = re.compile(r"^# (recipe-value|plsc-differs): (\w+)\.(\w+) = (.+?)  \((.+)\)$")
_BEHAVIOUR = re.compile(r"^# plsc-differs: ([a-z][a-z0-9-]*)  \((.+)\)$")

# What a recipe's training script and the libraries it calls fix, whatever its config file
# says (transcribed from insightface's recognition/arcface_torch train_v2.py, losses.py,
# lr_scheduler.py and backbones/; AdaFace's main.py and train_val.py; torch's defaults).
_TORCH_SCALER = {"AMP.init_loss_scaling": 65536.0}  # GradScaler(init_scale=2.**16)
TRAINER_FIXES = {
    "train_v2.py": {
        "Model.dropout": 0.0,  # get_model(cfg.network, dropout=0.0, ...)
        "Model.bn_unbiased_var": True,  # torch's BatchNorm: unbiased running variance
        "Loss.scale": 64.0,  # CombinedMarginLoss(64, ...)
        "Optimizer.base_batch_size": None,  # lr=cfg.lr whatever the number of GPUs
        "Optimizer.grad_clip": 5.0,  # clip_grad_norm_(backbone.parameters(), 5)
        "Optimizer.grad_allreduce_dtype": "float16",  # register_comm_hook(None, fp16_compress_hook)
        "LRScheduler.name": "poly",  # PolynomialLRWarmup, stepped every step
        "LRScheduler.power": 1.0,  # lr_scheduler.py's default power
        "LRScheduler.end_lr": 0.0,  # the decay reaches 0 at total_iters
        "LRScheduler.warmup_indexing": "arcface_torch",
    },
    "train_val.py": {
        "Model.bn_unbiased_var": True,
        "Optimizer.base_batch_size": None,  # --lr as it is
        "Optimizer.grad_clip": None,  # pl.Trainer without gradient_clip_val
        "Optimizer.grad_allreduce_dtype": "float32",  # Lightning's DDP, no compression hook
    },
}
TRAINER_FIXES_BY_CHOICE = {
    "train_v2.py": {("Optimizer", "name", "sgd"): {"Optimizer.momentum": 0.9},  # SGD(momentum=0.9)
                    ("Optimizer", "name", "adamw"): {"Optimizer.betas": [0.9, 0.999]},  # AdamW()
                    ("AMP", "enable", True): {**_TORCH_SCALER,
                                              "AMP.incr_every_n_steps": 100}},  # growth_interval
    "train_val.py": {("Optimizer", "name", "sgd"): {"Optimizer.momentum": 0.9},
                     ("AMP", "enable", True): {**_TORCH_SCALER,  # Lightning: GradScaler()
                                               "AMP.incr_every_n_steps": 2000}},
}
# torch's GradScaler: growth_factor 2.0, backoff_factor 0.5 (no config key sets them in plsc).
TORCH_SCALER_FACTORS = {"growth_factor": 2.0, "backoff_factor": 0.5}
# The share of tokens arcface_torch's ViTs mask in training: get_model passes the network's
# mask_ratio (0.05 for vit_{b,l}_dp005_mask_005), but forward_features uses it only as a
# switch and calls random_masking() with its default, 0.1.
ARCFACE_TORCH_MASKING = {"vit_t_dp005_mask0": 0.0, "vit_s_dp005_mask_0": 0.0,
                         "vit_b_dp005_mask_005": 0.1, "vit_l_dp005_mask_005": 0.1}


def _partial_fc(cfg, trainer):
    return trainer == "train_v2.py" and cfg["Loss"]["sample_ratio"] < 1


def _float16_scaling(cfg, trainer):
    return cfg["AMP"]["enable"] and cfg["AMP"]["dtype"] == "float16"


# Differences no config key expresses, and when each applies.
BEHAVIOURS = {
    # PartialFC_V2's dense gradient: torch's optimizer decays and moves every centre each step
    "unsampled-centres-frozen": _partial_fc,
    # torch's GradScaler has no floor; plsc's scale stops at 1 (then counts divergence)
    "loss-scale-floor": _float16_scaling,
    # AdaFace's train_val.py (split_parameters) exempts BatchNorm from weight decay
    "batchnorm-decayed": lambda cfg, trainer: trainer == "train_val.py",
}

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
    """(recipe line, {'Section.key': (kind, value)}, {behaviour: why}) from the comment lines
    before the YAML."""
    recipe, stated, behaviours = None, {}, {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            line = line.rstrip("\n")
            if line.startswith("# recipe:"):
                recipe = line.split(":", 1)[1].strip()
            m, b = _LINE.match(line), _BEHAVIOUR.match(line)
            if line.startswith(("# recipe-value:", "# plsc-differs:")) and not (m or b):
                raise AssertionError(f"{path}: malformed header line {line!r}")
            if b:
                assert b.group(1) not in behaviours, f"{path}: {b.group(1)} stated twice"
                behaviours[b.group(1)] = b.group(2)
            if m:
                kind, sec, key, value, _source = m.groups()
                name = f"{sec}.{key}"
                assert name not in stated, f"{path}: {name} stated twice"
                stated[name] = (kind, yaml.safe_load(value))
    return recipe, stated, behaviours


def recipe_trainer(path):
    """The training script's file name from the `# recipe-trainer:` line (None without)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("# recipe-trainer:"):
                return os.path.basename(line.split(":", 1)[1].split()[1])
    return None


def effective(cfg, dotted):
    """The config's value of `dotted`; a backbone option left null: the model name's."""
    sec, key = dotted.split(".")
    value = cfg[sec][key]
    if sec == "Model" and value is None and key in model_options(cfg["Model"]["name"]):
        value = MODELS[resolve_name(cfg["Model"]["name"])].defaults[key]
    return value


def _same(got, value):
    return got == value and type(got) is type(value) or (
        isinstance(got, float) and isinstance(value, (int, float)) and got == value)


def _path(name):
    return os.path.join(ROOT, "configs", name + ".yaml")


@pytest.mark.parametrize("name", RECIPE_CONFIGS)
def test_recipe_config_has_the_values_its_header_states(name):
    recipe, stated, _ = read_header(_path(name))
    assert recipe and re.match(r"^[\w.-]+/[\w.-]+ \S+\.(py|sh)\b", recipe), \
        f"{name}: no '# recipe: <owner/repo> <file>' line"
    cfg = load_config(_path(name))
    for dotted, (kind, value) in stated.items():
        sec, key = dotted.split(".")
        assert key in cfg[sec], f"{name}: header names {dotted}, not a config key"
        got = effective(cfg, dotted)
        assert _same(got, value), \
            f"{name}: {dotted} is {got!r} in the config, the header ({kind}) states {value!r}"
    needed = set(_ALWAYS)
    for (sec, key, choice), more in _BY_CHOICE.items():
        if cfg[sec][key] == choice:
            needed.update(more)
    missing = sorted(needed - set(stated))
    assert not missing, f"{name}: the header does not state {', '.join(missing)}"


def trainer_fixes(cfg, trainer):
    """{'Section.key': value} that `trainer` and its libraries fix for the config `cfg`."""
    fixed = dict(TRAINER_FIXES[trainer])
    for (sec, key, choice), more in TRAINER_FIXES_BY_CHOICE[trainer].items():
        if cfg[sec][key] == choice:
            fixed.update(more)
    if cfg["Model"]["name"] in ARCFACE_TORCH_MASKING:
        fixed["Model.mask_ratio"] = ARCFACE_TORCH_MASKING[cfg["Model"]["name"]]
    return fixed


@pytest.mark.parametrize("name", RECIPE_CONFIGS)
def test_every_difference_from_the_recipes_trainer_is_declared(name):
    """A value the recipe's training script (or a library default it relies on) fixes is the
    config's, or the header declares it `plsc-differs`; a header's `recipe-value` for it must
    be that value; the behaviours that apply are declared, and only those."""
    _, stated, behaviours = read_header(_path(name))
    trainer = recipe_trainer(_path(name))
    assert trainer in TRAINER_FIXES, f"{name}: no known '# recipe-trainer:' line ({trainer!r})"
    cfg = load_config(_path(name))
    for dotted, value in trainer_fixes(cfg, trainer).items():
        got = effective(cfg, dotted)
        kind = stated.get(dotted, (None, None))[0]
        if _same(got, value):
            assert kind != "plsc-differs", \
                f"{name}: the header declares {dotted} as differing, but it is {trainer}'s {value!r}"
        else:
            assert kind == "plsc-differs", (
                f"{name}: {dotted} is {got!r} where {trainer} fixes {value!r}, and the header "
                f"does not declare it (# plsc-differs: {dotted} = ...)")
    unknown = sorted(set(behaviours) - set(BEHAVIOURS))
    assert not unknown, f"{name}: the header declares unknown behaviours {unknown}"
    needed = {b for b, applies in BEHAVIOURS.items() if applies(cfg, trainer)}
    assert set(behaviours) == needed, (
        f"{name}: behaviours not declared: {sorted(needed - set(behaviours))}; declared but "
        f"not applying: {sorted(set(behaviours) - needed)}")


@pytest.mark.parametrize("name", [n for n in RECIPE_CONFIGS
                                  if load_config(_path(n))["AMP"]["enable"]])
def test_the_loss_scaler_built_from_a_recipe_config_has_the_trainers_settings(name):
    """The scaler the Trainer builds (build_loss_scaler) reads back the recipe trainer's
    GradScaler: initial scale, growth interval, and torch's growth and backoff factors."""
    cfg = load_config(_path(name))
    fixed = trainer_fixes(cfg, recipe_trainer(_path(name)))
    scaler = build_loss_scaler(cfg["AMP"])
    assert scaler.enabled
    assert (scaler.scale, scaler.growth_interval) == (fixed["AMP.init_loss_scaling"],
                                                      fixed["AMP.incr_every_n_steps"])
    assert {k: getattr(scaler, k) for k in TORCH_SCALER_FACTORS} == TORCH_SCALER_FACTORS


def test_header_parser_reads_values_and_rejects_malformed_lines(tmp_path):
    good = tmp_path / "a.yaml"
    good.write_text("# recipe: a/b c/d.py\n# recipe-value: Optimizer.lr = 0.1  (d.py: lr)\n"
                    "# plsc-differs: Optimizer.base_batch_size = 1024  (scaled)\n"
                    "# plsc-differs: loss-scale-floor  (stops at 1)\nGlobal: {}\n")
    assert read_header(str(good)) == ("a/b c/d.py", {
        "Optimizer.lr": ("recipe-value", 0.1),
        "Optimizer.base_batch_size": ("plsc-differs", 1024)}, {"loss-scale-floor": "stops at 1"})
    bad = tmp_path / "b.yaml"
    bad.write_text("# recipe-value: Optimizer.lr=0.1 (d.py)\nGlobal: {}\n")
    with pytest.raises(AssertionError, match="malformed"):
        read_header(str(bad))


def test_the_docs_table_lists_each_configs_declared_differences():
    """docs/training.md#recipes: one row a config, its `plsc-differs:` lines in header order."""
    with open(os.path.join(ROOT, "docs", "training.md"), encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("| config | declared differences |"):]
    table = table[:table.index("\n\n")]
    rows = dict(re.findall(r"^\| `(\w+)\.yaml` \| (`.*`) \|$", table, re.M))
    for name in RECIPE_CONFIGS:
        _, stated, behaviours = read_header(_path(name))
        declared = [f"`{k} = {v}`" for k, (kind, v) in stated.items() if kind == "plsc-differs"]
        declared += [f"`{b}`" for b in behaviours]
        assert rows.get(name, "").split("; ") == declared, f"docs/training.md: {name}'s row"
