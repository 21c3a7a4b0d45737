"""The configuration schema, YAML loading, `-o Section.key=value` overrides and validation.

A config is a mapping of sections to keys. Every key is declared in `SCHEMA`
with its type, default and rule (choices, range); a YAML file only states what
differs. Unknown keys, wrong types, values outside a key's rule and missing
required values raise `ConfigError` naming the key (and the closest valid key
for a misspelling). `check_key` checks one value, as `Entry`'s setters do.
"""
import copy
import numbers
import os
import re

import yaml

from .dtypes import FLOAT_DTYPES, HEAD_DTYPES, STATE_DTYPES
from .kernels.names import kernel_set
from .loss.table import (DEFAULT_MARGIN, MARGIN_KEYS, cosine_options, either, margin_names,
                         margin_row)
from .names import did_you_mean, resolve_name

__all__ = ["ConfigError", "SCHEMA", "load_config", "parse_override", "apply_overrides",
           "validate", "check_key", "default_config", "dump_config"]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, key and value."""


REQUIRED = object()
_NOUNS = {int: "integer", float: "number", str: "string", list: "list", dict: "mapping"}


_EXPONENT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _typed(value, types):
    """`value` if of one of `types` (numbers.Integral for int, Real for float; numpy numbers
    made Python ones, bool never a number), else None."""
    abcs = tuple({int: numbers.Integral, float: numbers.Real}.get(t, t) for t in types)
    if float in types and isinstance(value, str) and _EXPONENT.match(value):
        return float(value)  # YAML 1.1 (PyYAML) reads 1e-3 as a string: it wants 1.0e-3
    if isinstance(value, bool) or not isinstance(value, abcs):
        return None
    if isinstance(value, numbers.Number) and type(value) not in (int, float):
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    return value


class Key:
    """One setting: accepted type(s), default, one-line help and the rule its value meets:
    `choices`, `nullable`, a range (`low`: >=, `above`: >, `high`: <=), `nonempty` (a
    string), a list's `item` type (the range then applies to each item) and `length`;
    `unless`: a key of the same section whose being set waives the range; `known`: a
    registry's check of a name (raises ValueError with the closest name, e.g. `resolve_name`)."""

    def __init__(self, types, default, help, choices=None, nullable=False, low=None, above=None,
                 high=None, nonempty=False, item=None, length=None, unless=None, known=None):
        self.types = types if isinstance(types, tuple) else (types,)
        self.default, self.help, self.choices, self.nullable = default, help, choices, nullable
        self.low, self.above, self.high, self.nonempty = low, above, high, nonempty
        self.item, self.length, self.unless, self.known = item, length, unless, known

    def range_text(self):
        """The range as a config states it: '>= 1', '> 0', 'in (0, 1]' ('' for none)."""
        if self.high is not None:
            return (f"in ({self.above}, {self.high}]" if self.above is not None
                    else f"in [{self.low}, {self.high}]")
        if self.above is not None:
            return f"> {self.above}"
        return f">= {self.low}" if self.low is not None else ""

    def describe(self):
        """The whole rule in words: 'a positive integer', 'in (0, 1]', 'one of a, b'."""
        if bool in self.types:
            return "True or False"
        if self.choices is not None:
            return f"one of {', '.join(self.choices)}"
        if self.item is not None:
            size = f"{self.length} " if self.length else ""
            return f"a list of {size}{self._noun(self.item, 's')}"
        noun = self._noun(float if float in self.types else self.types[0], "")
        return noun if noun.startswith("in ") else ("an " if noun[0] in "aeiou" else "a ") + noun

    def _noun(self, t, s):
        if self.high is not None:  # an interval: 'in (0, 1]', 'numbers in (0, 1]'
            return f"{_NOUNS[t]}{s} {self.range_text()}" if s else self.range_text()
        if self.above == 0 or (self.low == 1 and t is int) or (self.nonempty and t is str):
            return f"{'non-empty' if t is str else 'positive'} {_NOUNS[t]}{s}"
        return f"{_NOUNS[t]}{s} {self.range_text()}".rstrip()

    def _allowed(self, value):
        if isinstance(value, str):
            return not (self.nonempty and value == "")
        low, above, high = self.low, self.above, self.high
        return ((low is None or value >= low) and (above is None or value > above)
                and (high is None or value <= high))

    def check(self, value, where, plain=False, section=None):
        """`value` checked and returned (numpy numbers as Python ones); a ConfigError names
        `where`. `plain`: the rule in Python's words (`describe`, None, True) instead of a
        config's; `section`: the values of the key's section, for `unless`."""
        null = (" or None" if plain else " or null") if self.nullable else ""
        rule = self.describe() + null
        if value is None:
            if self.nullable:
                return None
            raise ConfigError(f"{where} must be {rule}, got None" if plain else
                              f"{where} must not be null ({self.help})")
        if bool in self.types:
            if not isinstance(value, bool):
                rule = rule if plain else "true or false"
                raise ConfigError(f"{where} must be {rule}, got {value!r}")
            return value
        typed = _typed(value, self.types)
        if typed is None:
            if plain:
                raise ConfigError(f"{where} must be {rule}, got {value!r}")
            names = " or ".join("number" if t is float else t.__name__ for t in self.types
                                if not (t is int and float in self.types))
            raise ConfigError(f"{where} must be {names}, got {value!r} ({type(value).__name__})")
        if self.choices is not None and typed not in self.choices:
            hint = did_you_mean(typed, self.choices, listed=False) if isinstance(typed, str) else ""
            raise ConfigError(f"{where} must be {rule}, got {value!r}{hint}")
        if self.known is not None:
            try:
                self.known(typed)
            except ValueError as err:
                raise ConfigError(f"{where}: {err}") from None
        if self.item is not None:
            items = [_typed(v, (self.item,)) for v in typed]
            if (None in items or not all(self._allowed(v) for v in items)
                    or self.length not in (None, len(items))):
                raise ConfigError(f"{where} must be {rule}, got {value!r}")
            return items
        waived = self.unless is not None and (section or {}).get(self.unless) is not None
        if not (self._allowed(typed) or waived):
            text = rule if plain or not self.range_text() else self.range_text() + null
            raise ConfigError(f"{where} must be {text}, got {value!r}")
        return typed


def _k(types, default, help, **kw):
    return Key(types, default, help, **kw)


NUM = (int, float)
GRAD_SYNC_MODES = ("auto", "backward", "thread", "after")  # Optimizer.grad_sync: grad_sync.OverlappedSum
SCHEMA = {
    "Global": {
        "seed": _k(int, 0, "seed of initialisation, data order and sampling"),
        "output_dir": _k(str, "./output", "checkpoints, logs, VisualDL and exports go here",
                         nonempty=True),
        "device": _k(str, "auto", "auto (GPU when present), cpu or gpu", choices=("auto", "cpu", "gpu")),
        "epochs": _k(int, 20, "training epochs (ignored when max_steps is set)", low=1,
                     unless="max_steps"),
        "max_steps": _k(int, None, "stop after this many optimizer steps", nullable=True, low=1),
        "log_interval": _k(int, 20, "steps between log lines", low=1),
        "checkpoint": _k(str, None, "checkpoint to resume from: a folder, 'latest' (the newest "
                         "in output_dir) or 'auto' (the newest if any, else start fresh)",
                         nullable=True),
        "pretrained": _k(str, None, "backbone weights to start from: plsc's .pdparams or "
                         "arcface_torch's .pt/.pth (docs/weights.md)", nullable=True),
        "max_nonfinite_steps": _k(int, 3, "consecutive steps with a non-finite loss or gradient "
                                  "that are skipped before the run stops as diverged (exit 70; "
                                  "0: stop at the first); with float16 AMP, skips at the loss "
                                  "scaler's floor", low=0),
        "cpu_threads": _k(int, None, "CPU threads per rank; null: the rank's usable cores divided "
                          "by the ranks on its node (the user's OMP_NUM_THREADS is kept)",
                          nullable=True, low=1),
    },
    "Model": {
        "name": _k(str, "IResNet50", "backbone name in plsc.models (MODEL_NAMES, or an "
                   "arcface_torch name such as r50; any case)", known=resolve_name),
        "embedding_size": _k(int, 512, "embedding width", low=1),
        "dropout": _k(NUM, 0.0, "dropout before the embedding layer (ViTs: after the position "
                      "embedding, in the MLPs and after the attention projections)"),
        "drop_path_rate": _k(NUM, None, "ViTs only: stochastic depth of the last block, rising "
                             "linearly from 0 over the blocks; null: the model name's",
                             nullable=True, low=0, high=1),
        "mask_ratio": _k(NUM, None, "ViTs only: share of the tokens replaced by the learned mask "
                         "token in training (int(L*(1-ratio)) kept); null: the model name's",
                         nullable=True, low=0, high=1),
        "patch_size": _k(int, None, "ViTs only: patch side in pixels, (H//p)*(W//p) tokens; "
                         "null: the model name's (9: 144 tokens at 112x112)", nullable=True,
                         low=1),
        "recompute": _k(bool, None, "IResNets and ViTs: recompute each block's activations in "
                        "the backward instead of keeping them (same results, less memory, a "
                        "second forward); null: the model name's (arcface_torch's ViT-B/L/H: "
                        "true)", nullable=True),
        "bn_unbiased_var": _k(bool, True, "BatchNorm running variance updated with the unbiased "
                              "batch variance (x n/(n-1)), as torch's and so arcface_torch's; "
                              "false: Paddle's biased one"),
    },
    "Loss": {
        # the margin and the keys margins read: the margins' table
        "margin": _k(str, DEFAULT_MARGIN, either(margin_names()), choices=margin_names()),
        **{key: _k(spec.types, spec.default, spec.help, **spec.rule)
           for key, spec in MARGIN_KEYS.items()},
        "sub_centers": _k(int, 1, "centres per class (sub-center ArcFace; normalised margins); "
                          "a class's cosine is the largest of its centres'", low=1),
        "interclass_filtering_threshold": _k(
            NUM, 0.0, "arcface_torch's inter-class filtering for noisy data: a non-target class "
            "whose cosine with a sample is above this gets logit 0 (still in the softmax's sum) "
            "and no gradient, the target never; 0: off (normalised margins only)", low=0, high=1),
        "num_classes": _k(int, REQUIRED, "number of identities", low=1),
        "sample_ratio": _k(NUM, 1.0, "Partial FC ratio of class centres per step", above=0,
                            high=1),
        "chunk_size": _k(int, None, "classes per block of the logit-free head; null: automatic "
                         "(dense while the logits fit in logits_budget_mb); 0: always dense",
                         nullable=True, low=0),
        "logits_budget_mb": _k(NUM, 2048, "memory the head's logits may take per rank when "
                               "chunk_size is automatic", above=0),
        "param_dtype": _k(str, "float32", "storage of the class centres: float32, bfloat16, "
                          "float16 or int8 (a byte per value, a scale per row); GEMMs and softmax "
                          "statistics stay float32",
                          choices=HEAD_DTYPES),
    },
    "Data": {
        "dataset": _k(str, "recordio", "recordio (train.rec/.idx), folder, list or synthetic",
                      choices=("recordio", "folder", "list", "synthetic")),
        "root": _k(str, REQUIRED, "dataset directory (or list file for 'list')", nonempty=True),
        "image_size": _k(list, [112, 112], "[height, width] fed to the backbone", item=int,
                          low=1, length=2),
        "batch_size": _k(int, 128, "per-rank batch size", low=1),
        "num_workers": _k(int, 2, "data loading worker processes per rank (0: the rank itself)",
                           low=0),
        "skip_bad": _k(int, 0, "bad samples (undecodable image, corrupt record) a rank may skip "
                       "per epoch, each replaced by the next good one; 0: stop at the first", low=0),
        "random_flip": _k(bool, True, "random horizontal flip in training"),
        "block_shuffle": _k(int, 0, "shuffle blocks of this many consecutive samples, then within "
                            "windows of shuffle_buffer blocks (long sequential reads of a .rec on a "
                            "slow disk); 0: plain per-sample shuffle", low=0),
        "shuffle_buffer": _k(int, 64, "blocks per shuffle window with block_shuffle", low=1),
        "device_prefetch": _k(bool, False, "load the next batch and copy it to the device in a "
                              "background thread while the step runs (worth it on a GPU)"),
        "synthetic": _k(dict, {}, "arguments of plsc.data generate_synthetic (dataset: synthetic)"),
    },
    "Optimizer": {
        "name": _k(str, "sgd", "sgd (with momentum) or adamw", choices=("sgd", "adamw")),
        "lr": _k(NUM, 0.1, "learning rate for a global batch of base_batch_size", above=0),
        "base_batch_size": _k(int, None, "lr scales linearly to the real global batch; null: no "
                              "scaling", nullable=True),
        "momentum": _k(NUM, 0.9, "SGD momentum"),
        "weight_decay": _k(NUM, 5e-4, "weight decay (L2 for sgd, decoupled for adamw)"),
        "betas": _k(list, [0.9, 0.999], "AdamW betas"),
        "grad_clip": _k(NUM, None, "global-norm clip of the backbone gradients", nullable=True),
        "accumulate_steps": _k(int, 1, "micro-batches per optimizer step", low=1),
        "head_state_dtype": _k(str, None, "storage of the head's optimizer state; null: that of "
                               "the class centres (Loss.param_dtype); int4: 4 bits a value, "
                               "momentum and moments only", nullable=True,
                               choices=STATE_DTYPES),
        "head_write_rounding": _k(str, "stochastic", "how 16- and 8-bit head arrays are written: "
                                  "stochastic (unbiased) or nearest",
                                  choices=("stochastic", "nearest")),
        "fused_head_update": _k(bool, True, "update the head's rows inside its backward (no "
                                "weight-gradient array) where that is exact: no gradient "
                                "accumulation, no float16 loss scaling"),
        "grad_allreduce_dtype": _k(str, "float32", "what the backbone's gradient all-reduce "
                                   "sends: float32, or float16/bfloat16 (half the bytes, as "
                                   "arcface_torch's fp16 compression hook; the sum comes back "
                                   "rounded to it)", choices=FLOAT_DTYPES),
        "grad_sync": _k(str, "auto", "where the backbone's gradient all-reduces start: "
                        "backward (each bucket from the backward's hooks as its gradients are "
                        "complete), thread (the hooks hand it to a communication thread: "
                        "concurrent with the backward on gloo too), after (all after the "
                        "backward); auto: thread on the CPU, backward on a GPU",
                        choices=GRAD_SYNC_MODES),
    },
    "LRScheduler": {
        "name": _k(str, "poly", "poly, piecewise or cosine", choices=("poly", "piecewise", "cosine")),
        "warmup_epochs": _k(NUM, 0, "linear warmup length in epochs", low=0),
        "warmup_steps": _k(int, None, "linear warmup length in steps (overrides epochs)",
                           nullable=True),
        "warmup_indexing": _k(str, "plsc", "plsc: warmup step i (0-based) gets (i+1)/W of the "
                              "rate; arcface_torch: as train_v2.py's PolynomialLRWarmup, step 0 "
                              "the full rate and step i in 1..W i/W (docs/training.md#recipes)",
                              choices=("plsc", "arcface_torch")),
        "power": _k(NUM, 2.0, "poly: decay power (arcface_torch's PolynomialLRWarmup: 1)"),
        "end_lr": _k(NUM, 0.0, "poly/cosine: final learning rate"),
        "boundaries": _k(list, [], "piecewise: epochs at which lr is multiplied by gamma",
                          item=int, low=1),
        "gamma": _k(NUM, 0.1, "piecewise: factor at each boundary", above=0),
    },
    "AMP": {
        "enable": _k(bool, False, "mixed precision (GPU)"),
        "dtype": _k(str, "float16", "float16 (dynamic loss scaling) or bfloat16",
                    choices=("float16", "bfloat16")),
        "init_loss_scaling": _k(NUM, 65536.0, "float16: initial loss scale"),
        "incr_every_n_steps": _k(int, 2000, "float16: good steps in a row after which the loss "
                                 "scale doubles (torch's GradScaler growth_interval; "
                                 "arcface_torch's train_v2.py: 100)", low=1),
    },
    "Eval": {
        "root": _k(str, None, "directory holding the verification packs (<target>.bin)",
                   nullable=True),
        "targets": _k(list, [], "verification packs, e.g. [lfw, cfp_fp, agedb_30]", item=str,
                       nonempty=True),
        "interval": _k(int, 2000, "steps between evaluations (and at the end)", low=1),
        "batch_size": _k(int, 128, "per-rank batch size of embedding extraction", low=1),
        "before_training": _k(bool, False, "also evaluate the untrained model (step 0)"),
    },
    "Checkpoint": {
        "interval": _k(int, 2000, "steps between checkpoints (and at the end)", low=1),
        "keep_last": _k(int, 3, "checkpoints kept (older ones are deleted)", low=1),
        "verify": _k(str, "full", "check a checkpoint against its manifest before resuming: "
                     "full (sizes and checksums), size or none", choices=("full", "size", "none")),
        "grace_seconds": _k(NUM, 30, "seconds a stop signal leaves before the cluster's SIGKILL "
                            "(0: no limit): a stop checkpoint predicted not to end in time is "
                            "not started, the run resumes from its last periodic checkpoint",
                            low=0),
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


def check_key(section, key, value, name=None):
    """`value` checked against the rule of `section.key` and returned (numpy numbers as
    Python ones). The ConfigError names `name` in Python's words ('class_num must be a
    positive integer') or, without one, the key as a config does ('Loss.num_classes must
    be >= 1')."""
    if section not in SCHEMA:
        raise ConfigError(f"unknown section '{section}'{did_you_mean(str(section), SCHEMA)}")
    if key not in SCHEMA[section]:
        raise ConfigError(f"unknown key '{section}.{key}'{did_you_mean(str(key), SCHEMA[section])}")
    return SCHEMA[section][key].check(value, name or f"{section}.{key}", plain=name is not None)


def validate(raw, source="config"):
    """Defaults filled in, every key checked. Returns a new nested dict."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got "
                          f"{type(raw).__name__}")
    cfg, given = default_config(), []
    for sec, values in raw.items():
        if sec not in SCHEMA:
            raise ConfigError(f"{source}: unknown section '{sec}'{did_you_mean(str(sec), SCHEMA)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{sec}' must be a mapping, got {values!r}")
        for key, value in values.items():
            if key not in SCHEMA[sec]:
                raise ConfigError(f"{source}: unknown key '{sec}.{key}'"
                                  f"{did_you_mean(str(key), SCHEMA[sec])}")
            cfg[sec][key] = value
            given.append((sec, key))
    for sec, key in given:  # once the sections are complete, for Key.unless
        cfg[sec][key] = SCHEMA[sec][key].check(cfg[sec][key], f"{source}: {sec}.{key}",
                                               section=cfg[sec])
    for sec, keys in SCHEMA.items():
        for key, spec in keys.items():
            if spec.default is REQUIRED and key not in cfg[sec]:
                raise ConfigError(f"{source}: {sec}.{key} is required ({spec.help})")
    _check_combinations(cfg, source)
    _check_environment()
    return cfg


def _check_combinations(cfg, source):
    """The rules that relate keys (each key's own rule is in its `Key`)."""
    loss = cfg["Loss"]
    if not margin_row(loss["margin"]).normalized:
        for key, value, why in cosine_options(loss["sub_centers"],
                                              loss["interclass_filtering_threshold"]):
            raise ConfigError(f"{source}: Loss.{key}={value} needs a normalised margin "
                              f"({either(margin_names(normalized=True))}; {why}), "
                              f"not {loss['margin']}")


def _check_environment():
    """The settings read from the environment rather than the config: PLSC_KERNELS."""
    try:
        kernel_set()
    except ValueError as err:
        raise ConfigError(f"environment: {err}") from None


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
        raise ConfigError(f"override {text!r}: the value is not valid YAML "
                          f"({_one_line(e)})") from None


def _one_line(error):
    """PyYAML's message of `error` on one line (it spans three: the problem, the context, the
    line and column)."""
    return " ".join(str(error).split())


def apply_overrides(raw, overrides):
    raw = copy.deepcopy(raw)
    for text in overrides or ():
        (sec, key), value = parse_override(text)
        if sec not in SCHEMA:
            raise ConfigError(f"override {text!r}: unknown section '{sec}'"
                              f"{did_you_mean(sec, SCHEMA)}")
        if not isinstance(raw.get(sec), dict):
            raw[sec] = {}
        raw[sec][key] = value
    return raw


def load_config(path, overrides=()):
    """Read a YAML config, apply `-o` overrides, validate. Returns a nested dict."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist" if not os.path.exists(path) else
                          f"config file {path} is a folder, expected a YAML file")
    with open(path, encoding="utf-8") as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({_one_line(e)})") from None
        except UnicodeDecodeError as e:  # an image, a .npy, a .pt given as the config
            raise ConfigError(f"config file {path} is not a text file (byte {e.start} is not "
                              "UTF-8), expected a YAML file such as configs/demo.yaml") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} holds a YAML {type(raw).__name__}, expected "
                          "sections such as 'Global:' and 'Model:'")
    return validate(apply_overrides(raw, overrides), source=path)


def dump_config(cfg):
    return yaml.safe_dump(cfg, sort_keys=False)
