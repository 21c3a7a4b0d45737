"""The configuration schema, YAML loading, `-o Section.key=value` overrides and validation.

A config is a mapping of sections to keys. Every key is declared in `SCHEMA`
with its type and default; a YAML file only states what differs. Unknown
keys, wrong types and missing required values raise `ConfigError` naming the
key (and the closest valid key for a misspelling).
"""
import copy
import difflib
import os

import yaml

__all__ = ["ConfigError", "SCHEMA", "load_config", "parse_override", "apply_overrides",
           "validate", "default_config", "dump_config"]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, key and value."""


REQUIRED = object()


class Key:
    """One setting: accepted type(s), default, optional choices, one-line help."""

    def __init__(self, types, default, help, choices=None, nullable=False):
        self.types = types if isinstance(types, tuple) else (types,)
        self.default, self.help, self.choices, self.nullable = default, help, choices, nullable


def _k(types, default, help, **kw):
    return Key(types, default, help, **kw)


NUM = (int, float)
SCHEMA = {
    "Global": {
        "seed": _k(int, 0, "seed of initialisation, data order and sampling"),
        "output_dir": _k(str, "./output", "checkpoints, logs, VisualDL and exports go here"),
        "device": _k(str, "auto", "auto (GPU when present), cpu or gpu", choices=("auto", "cpu", "gpu")),
        "epochs": _k(int, 20, "training epochs (ignored when max_steps is set)"),
        "max_steps": _k(int, None, "stop after this many optimizer steps", nullable=True),
        "log_interval": _k(int, 20, "steps between log lines"),
        "checkpoint": _k(str, None, "checkpoint to resume from: a folder, 'latest' (the newest "
                         "in output_dir) or 'auto' (the newest if any, else start fresh)",
                         nullable=True),
        "pretrained": _k(str, None, "backbone weights (.pdparams) to start from", nullable=True),
        "cpu_threads": _k(int, None, "CPU threads per rank; null: the rank's usable cores divided "
                          "by the ranks on its node (an OMP_NUM_THREADS above 1 is kept)",
                          nullable=True),
    },
    "Model": {
        "name": _k(str, "IResNet50", "backbone name in plsc.models"),
        "embedding_size": _k(int, 512, "embedding width"),
        "dropout": _k(NUM, 0.0, "dropout before the embedding layer"),
    },
    "Loss": {
        "margin": _k(str, "arcface", "arcface, cosface, sphereface, combined, adaface or softmax",
                     choices=("arcface", "cosface", "sphereface", "combined", "adaface", "softmax")),
        "scale": _k(NUM, 64.0, "logit scale s"),
        "m1": _k(NUM, 1.0, "multiplicative angular margin (combined, sphereface)"),
        "m2": _k(NUM, 0.5, "additive angular margin (combined, arcface)"),
        "m3": _k(NUM, 0.0, "additive cosine margin (combined, cosface)"),
        "straight_through": _k(bool, False, "insightface's margin gradient instead of the exact one"),
        "adaface_m": _k(NUM, 0.4, "AdaFace margin m"),
        "adaface_h": _k(NUM, 0.333, "AdaFace h: how far the feature norm moves the margin"),
        "adaface_t_alpha": _k(NUM, 0.01, "AdaFace momentum of the running norm statistics"),
        "sub_centers": _k(int, 1, "centres per class (sub-center ArcFace; normalised margins); "
                          "a class's cosine is the largest of its centres'"),
        "num_classes": _k(int, REQUIRED, "number of identities"),
        "sample_ratio": _k(NUM, 1.0, "Partial FC ratio of class centres per step, in (0, 1]"),
        "chunk_size": _k(int, None, "classes per block of the logit-free head; null: automatic "
                         "(dense while the logits fit in logits_budget_mb); 0: always dense",
                         nullable=True),
        "logits_budget_mb": _k(NUM, 2048, "memory the head's logits may take per rank when "
                               "chunk_size is automatic"),
        "param_dtype": _k(str, "float32", "storage of the class centres: float32, bfloat16 or "
                          "float16 (GEMMs and softmax statistics stay float32)",
                          choices=("float32", "bfloat16", "float16")),
    },
    "Data": {
        "dataset": _k(str, "recordio", "recordio (train.rec/.idx), folder, list or synthetic",
                      choices=("recordio", "folder", "list", "synthetic")),
        "root": _k(str, REQUIRED, "dataset directory (or list file for 'list')"),
        "image_size": _k(list, [112, 112], "[height, width] fed to the backbone"),
        "batch_size": _k(int, 128, "per-rank batch size"),
        "num_workers": _k(int, 2, "data loading worker processes per rank (0: the rank itself)"),
        "skip_bad": _k(int, 0, "bad samples (undecodable image, corrupt record) a rank may skip "
                       "per epoch, each replaced by the next good one; 0: stop at the first"),
        "random_flip": _k(bool, True, "random horizontal flip in training"),
        "synthetic": _k(dict, {}, "arguments of plsc.data generate_synthetic (dataset: synthetic)"),
    },
    "Optimizer": {
        "name": _k(str, "sgd", "sgd (with momentum) or adamw", choices=("sgd", "adamw")),
        "lr": _k(NUM, 0.1, "learning rate for a global batch of base_batch_size"),
        "base_batch_size": _k(int, None, "lr scales linearly to the real global batch; null: no "
                              "scaling", nullable=True),
        "momentum": _k(NUM, 0.9, "SGD momentum"),
        "weight_decay": _k(NUM, 5e-4, "weight decay (L2 for sgd, decoupled for adamw)"),
        "betas": _k(list, [0.9, 0.999], "AdamW betas"),
        "grad_clip": _k(NUM, None, "global-norm clip of the backbone gradients", nullable=True),
        "accumulate_steps": _k(int, 1, "micro-batches per optimizer step"),
        "head_state_dtype": _k(str, None, "storage of the head's optimizer state; null: that of "
                               "the class centres (Loss.param_dtype)", nullable=True,
                               choices=("float32", "bfloat16", "float16")),
        "head_write_rounding": _k(str, "stochastic", "how 16-bit head arrays are written: "
                                  "stochastic (unbiased) or nearest",
                                  choices=("stochastic", "nearest")),
        "fused_head_update": _k(bool, True, "update the head's rows inside its backward (no "
                                "weight-gradient array) where that is exact: no gradient "
                                "accumulation, no float16 loss scaling"),
    },
    "LRScheduler": {
        "name": _k(str, "poly", "poly, piecewise or cosine", choices=("poly", "piecewise", "cosine")),
        "warmup_epochs": _k(NUM, 0, "linear warmup length in epochs"),
        "warmup_steps": _k(int, None, "linear warmup length in steps (overrides epochs)",
                           nullable=True),
        "power": _k(NUM, 2.0, "poly: decay power"),
        "end_lr": _k(NUM, 0.0, "poly/cosine: final learning rate"),
        "boundaries": _k(list, [], "piecewise: epochs at which lr is multiplied by gamma"),
        "gamma": _k(NUM, 0.1, "piecewise: factor at each boundary"),
    },
    "AMP": {
        "enable": _k(bool, False, "mixed precision (GPU)"),
        "dtype": _k(str, "float16", "float16 (dynamic loss scaling) or bfloat16",
                    choices=("float16", "bfloat16")),
        "init_loss_scaling": _k(NUM, 65536.0, "float16: initial loss scale"),
    },
    "Eval": {
        "root": _k(str, None, "directory holding the verification packs (<target>.bin)",
                   nullable=True),
        "targets": _k(list, [], "verification packs, e.g. [lfw, cfp_fp, agedb_30]"),
        "interval": _k(int, 2000, "steps between evaluations (and at the end)"),
        "batch_size": _k(int, 128, "per-rank batch size of embedding extraction"),
        "before_training": _k(bool, False, "also evaluate the untrained model (step 0)"),
    },
    "Checkpoint": {
        "interval": _k(int, 2000, "steps between checkpoints (and at the end)"),
        "keep_last": _k(int, 3, "checkpoints kept (older ones are deleted)"),
        "verify": _k(str, "full", "check a checkpoint against its manifest before resuming: "
                     "full (sizes and checksums), size or none", choices=("full", "size", "none")),
    },
    "Logging": {
        "visualdl": _k(bool, True, "write VisualDL scalars under output_dir/vdl"),
        "progress_bar": _k(bool, True, "a progress bar when stdout is a terminal"),
    },
}


def default_config():
    """Every section with its defaults (required keys left out)."""
    return {sec: {k: copy.deepcopy(v.default) for k, v in keys.items() if v.default is not REQUIRED}
            for sec, keys in SCHEMA.items()}


def _suggest(name, options):
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid: {', '.join(options)}"


def _check_value(where, key, value):
    if value is None:
        if key.nullable:
            return None
        raise ConfigError(f"{where} must not be null ({key.help})")
    if bool in key.types:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, key.types):
        names = " or ".join("number" if t is float else t.__name__ for t in key.types
                            if not (t is int and float in key.types))
        raise ConfigError(f"{where} must be {names}, got {value!r} ({type(value).__name__})")
    if key.choices is not None and value not in key.choices:
        raise ConfigError(f"{where} must be one of {', '.join(key.choices)}, got {value!r}")
    return value


def validate(raw, source="config"):
    """Defaults filled in, every key checked. Returns a new nested dict."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got "
                          f"{type(raw).__name__}")
    cfg = default_config()
    for sec, values in raw.items():
        if sec not in SCHEMA:
            raise ConfigError(f"{source}: unknown section '{sec}'{_suggest(str(sec), SCHEMA)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{sec}' must be a mapping, got {values!r}")
        for key, value in values.items():
            if key not in SCHEMA[sec]:
                raise ConfigError(f"{source}: unknown key '{sec}.{key}'"
                                  f"{_suggest(str(key), SCHEMA[sec])}")
            cfg[sec][key] = _check_value(f"{source}: {sec}.{key}", SCHEMA[sec][key], value)
    for sec, keys in SCHEMA.items():
        for key, spec in keys.items():
            if spec.default is REQUIRED and key not in cfg[sec]:
                raise ConfigError(f"{source}: {sec}.{key} is required ({spec.help})")
    _check_ranges(cfg, source)
    return cfg


def _check_ranges(cfg, source):
    def need(cond, what):
        if not cond:
            raise ConfigError(f"{source}: {what}")

    g, loss, data, opt = cfg["Global"], cfg["Loss"], cfg["Data"], cfg["Optimizer"]
    need(loss["num_classes"] >= 1, f"Loss.num_classes must be >= 1, got {loss['num_classes']}")
    need(0.0 < loss["sample_ratio"] <= 1.0,
         f"Loss.sample_ratio must be in (0, 1], got {loss['sample_ratio']}")
    need(loss["scale"] > 0, f"Loss.scale must be > 0, got {loss['scale']}")
    need(loss["sub_centers"] >= 1, f"Loss.sub_centers must be >= 1, got {loss['sub_centers']}")
    need(loss["sub_centers"] == 1 or loss["margin"] != "softmax",
         f"Loss.sub_centers={loss['sub_centers']} needs a normalised margin (arcface, cosface, "
         "sphereface, combined or adaface), not softmax")
    need(0.0 <= loss["adaface_t_alpha"] <= 1.0,
         f"Loss.adaface_t_alpha must be in [0, 1], got {loss['adaface_t_alpha']}")
    need(loss["chunk_size"] is None or loss["chunk_size"] >= 0,
         f"Loss.chunk_size must be null, 0 or positive, got {loss['chunk_size']}")
    need(loss["logits_budget_mb"] > 0, f"Loss.logits_budget_mb must be > 0, got {loss['logits_budget_mb']}")
    need(data["batch_size"] >= 1, f"Data.batch_size must be >= 1, got {data['batch_size']}")
    need(g["cpu_threads"] is None or g["cpu_threads"] >= 1,
         f"Global.cpu_threads must be >= 1 or null, got {g['cpu_threads']}")
    for key in ("num_workers", "skip_bad"):
        need(data[key] >= 0, f"Data.{key} must be >= 0, got {data[key]}")
    need(len(data["image_size"]) == 2 and all(isinstance(v, int) and v > 0 for v in data["image_size"]),
         f"Data.image_size must be [height, width] of positive ints, got {data['image_size']}")
    need(g["epochs"] >= 1 or g["max_steps"], f"Global.epochs must be >= 1, got {g['epochs']}")
    need(g["max_steps"] is None or g["max_steps"] >= 1,
         f"Global.max_steps must be >= 1 or null, got {g['max_steps']}")
    need(opt["lr"] > 0, f"Optimizer.lr must be > 0, got {opt['lr']}")
    need(opt["accumulate_steps"] >= 1,
         f"Optimizer.accumulate_steps must be >= 1, got {opt['accumulate_steps']}")
    for sec, key in (("Global", "log_interval"), ("Eval", "interval"), ("Checkpoint", "interval"),
                     ("Checkpoint", "keep_last")):
        need(cfg[sec][key] >= 1, f"{sec}.{key} must be >= 1, got {cfg[sec][key]}")


def parse_override(text):
    """'Section.key=value' -> (['Section', 'key'], value), the value read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like Section.key=value")
    path, value = text.split("=", 1)
    keys = path.strip().split(".")
    if len(keys) != 2 or not all(keys):
        raise ConfigError(f"override {text!r}: the key must be Section.key, got {path!r}")
    try:
        return keys, yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({e})") from None


def apply_overrides(raw, overrides):
    raw = copy.deepcopy(raw)
    for text in overrides or ():
        (sec, key), value = parse_override(text)
        if sec not in SCHEMA:
            raise ConfigError(f"override {text!r}: unknown section '{sec}'{_suggest(sec, SCHEMA)}")
        if not isinstance(raw.get(sec), dict):
            raw[sec] = {}
        raw[sec][key] = value
    return raw


def load_config(path, overrides=()):
    """Read a YAML config, apply `-o` overrides, validate. Returns a nested dict."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from None
    return validate(apply_overrides(raw, overrides), source=path)


def dump_config(cfg):
    return yaml.safe_dump(cfg, sort_keys=False)
