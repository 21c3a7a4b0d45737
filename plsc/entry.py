"""`Entry`: the Python API PLSC's users know, over the same config, training loop and tools.

    from plsc import Entry
    ins = Entry()
    ins.set_model_name("IResNet50")
    ins.set_class_num(93431)
    ins.set_loss_type("dist_arcface")
    ins.set_dataset_dir("./train_data")
    ins.train()

Every setter writes config keys, each value checked at once against that key's rule in
the config schema (a bad value raises ValueError naming the setter's argument); `train`,
`test`, `convert_for_prediction` and `predict` build the validated config and call the
trainer and the apps, exactly as the tools do.
"""
import copy
import os

import numpy as np

from .config import SCHEMA, ConfigError, apply_overrides, check_key, load_config, validate
from .loss import AdaFace
from .loss.table import loss_types, margin_row
from .models import MODELS, resolve_name

__all__ = ["Entry", "LOSS_TYPES"]

# From the margins' table.
LOSS_TYPES = loss_types()
"""{PLSC loss type: (margin, scale, m1, m2, m3)}, e.g. `dist_arcface`, as `set_loss_type`
writes them."""


def _checked(section, key, value, name):
    """`value` checked against the schema's rule for `section.key` (ValueError naming
    `name`); a number key's value as a float."""
    try:
        value = check_key(section, key, value, name)
    except ConfigError as err:
        raise ValueError(str(err)) from None
    return float(value) if float in SCHEMA[section][key].types and value is not None else value


class Entry:
    """Configure with setters (or `Entry.from_config`), then train, test, export, predict."""

    def __init__(self, config=None):
        self._raw = copy.deepcopy(config) if config else {}
        self._model = None

    @classmethod
    def from_config(cls, path, overrides=()):
        """An Entry holding a YAML config (with `-o`-style overrides)."""
        load_config(path, overrides)  # fail early on a bad file
        import yaml
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
        return cls(apply_overrides(raw, overrides))

    def _set(self, section, key, value, name):
        """Write `value` to `section.key` once it passes that key's check (ValueError naming
        the setter's argument `name`)."""
        return self._set_all((section, key, value, name))

    def _set_all(self, *settings):
        """Write (section, key, value, name) settings once every value has passed its check."""
        checked = [(sec, key, _checked(sec, key, value, name))
                   for sec, key, value, name in settings]
        for sec, key, value in checked:
            self._raw.setdefault(sec, {})[key] = value
        return self

    # ---------------------------------------------------------------- setters
    def set_model_name(self, name):
        """Backbone `Model.name`: a registered name in any case, or an insightface alias."""
        try:
            name = resolve_name(name)
        except ValueError as err:
            raise ValueError(f"set_model_name: {err}") from None
        return self._set("Model", "name", name, "model_name")

    def set_model(self, model):
        """Use a `paddle.nn.Layer` as the backbone instead of a registered name."""
        import paddle
        if not isinstance(model, paddle.nn.Layer):
            raise ValueError(f"set_model needs a paddle.nn.Layer, got {type(model).__name__}")
        self._model = model
        return self

    def set_class_num(self, num):
        """Number of classes (identities), `Loss.num_classes`."""
        return self._set("Loss", "num_classes", num, "class_num")

    def set_emb_size(self, size):
        """Embedding width, `Model.embedding_size`."""
        return self._set("Model", "embedding_size", size, "emb_size")

    def set_loss_type(self, loss_type):
        """A PLSC loss type (`LOSS_TYPES`): its margin and `Loss.scale`, `m1`, `m2`, `m3`."""
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
        return self._set_all(*(("Loss", key, value, key) for key, value in
                           zip(("margin", "scale", "m1", "m2", "m3"), LOSS_TYPES[loss_type])))

    def set_margin(self, scale=None, m1=None, m2=None, m3=None):
        """`Loss.scale`, `m1`, `m2`, `m3` (None: left as they are)."""
        return self._set_all(*(("Loss", key, value, key) for key, value in
                           (("scale", scale), ("m1", m1), ("m2", m2), ("m3", m3))
                           if value is not None))

    def set_adaface(self, scale=None, m=None, h=None, t_alpha=None):
        """Train with the AdaFace margin (defaults: s=64, m=0.4, h=0.333, t_alpha=0.01)."""
        return self._use_margin(AdaFace, s=scale, m=m, h=h, t_alpha=t_alpha)

    def _use_margin(self, cls, **args):
        """Train with margin class `cls`; `args` (None: left as they are) by its constructor's
        names, each written to the config key the margins' table gives it."""
        row = margin_row(class_name=cls.__name__)
        return self._set_all(("Loss", "margin", row.name, "margin"), *(
            ("Loss", row.args[arg], value, row.args[arg]) for arg, value in args.items()
            if value is not None))

    def set_sub_centers(self, k):
        """K centres per class (sub-center ArcFace); 1 turns them off."""
        return self._set("Loss", "sub_centers", k, "sub_centers")

    def set_sample_ratio(self, ratio):
        """Partial FC: the ratio of class centres each step uses, `Loss.sample_ratio`."""
        return self._set("Loss", "sample_ratio", ratio, "sample_ratio")

    def set_chunk_size(self, chunk_size=None, logits_budget_mb=None):
        """Logit-free head: classes per block (None: automatic from the budget; 0: dense)."""
        budget = () if logits_budget_mb is None else (
            ("Loss", "logits_budget_mb", logits_budget_mb, "logits_budget_mb"),)
        return self._set_all(("Loss", "chunk_size", chunk_size, "chunk_size"), *budget)

    def set_param_dtype(self, dtype, state_dtype=None, rounding=None):
        """Storage of the class centres (and, `state_dtype`, of their optimizer state; None:
        the centres' dtype): "float32", "bfloat16", "float16" or "int8" (the state also "int4").
        `rounding` of 16-, 8- and 4-bit writes: "stochastic" (default) or "nearest"."""
        rounding = () if rounding is None else (
            ("Optimizer", "head_write_rounding", rounding, "rounding"),)
        return self._set_all(("Loss", "param_dtype", dtype, "dtype"),
                         ("Optimizer", "head_state_dtype", state_dtype, "state_dtype"), *rounding)

    def set_fused_head_update(self, enable):
        """Update the head inside its backward where exact (default True)."""
        return self._set("Optimizer", "fused_head_update", enable, "fused_head_update")

    def set_train_batch_size(self, size):
        """Per-rank training batch size, `Data.batch_size`."""
        return self._set("Data", "batch_size", size, "train_batch_size")

    def set_test_batch_size(self, size):
        """Per-rank batch size of evaluation, `Eval.batch_size`."""
        return self._set("Eval", "batch_size", size, "test_batch_size")

    def set_dataset_dir(self, path):
        """Training data: a folder with train.rec/train.idx (and the verification packs)."""
        self._set("Data", "root", path, "dataset_dir")
        self._raw.setdefault("Eval", {}).setdefault("root", path)
        return self

    def set_dataset_type(self, kind):
        """`Data.dataset`: recordio, folder, list or synthetic."""
        return self._set("Data", "dataset", kind, "dataset_type")

    def set_image_size(self, height, width=None):
        """`Data.image_size` `[height, width]` (width: height when not given)."""
        return self._set("Data", "image_size", [height, width or height], "image_size")

    def set_model_save_dir(self, path):
        """Output folder (checkpoints, logs, exports), `Global.output_dir`."""
        return self._set("Global", "output_dir", path, "model_save_dir")

    def set_checkpoint_dir(self, path):
        """Resume from (or evaluate) a checkpoint folder, or 'latest' in model_save_dir."""
        if not isinstance(path, str) or not (path == "latest" or os.path.isdir(path)):
            raise ValueError(f"checkpoint_dir must be an existing checkpoint folder or 'latest', "
                             f"got {path!r}")
        return self._set("Global", "checkpoint", path, "checkpoint_dir")

    def set_train_epochs(self, epochs):
        """Train `epochs` epochs (`Global.epochs`; clears `Global.max_steps`)."""
        return self._set_all(("Global", "max_steps", None, "train_steps"),
                         ("Global", "epochs", epochs, "train_epochs"))

    def set_train_steps(self, steps):
        """Stop after `steps` optimizer steps, `Global.max_steps`."""
        return self._set("Global", "max_steps", steps, "train_steps")

    def set_warmup_epochs(self, epochs):
        """Linear warmup length in epochs, `LRScheduler.warmup_epochs`."""
        return self._set("LRScheduler", "warmup_epochs", epochs, "warmup_epochs")

    def set_lr(self, lr):
        """Learning rate, `Optimizer.lr`."""
        return self._set("Optimizer", "lr", lr, "lr")

    def set_lr_steps(self, boundaries, gamma=0.1):
        """Piecewise decay: multiply the rate by `gamma` at each epoch in `boundaries`."""
        steps = _checked("LRScheduler", "boundaries", list(boundaries) if isinstance(
            boundaries, tuple) else boundaries, "lr_steps")
        return self._set_all(("LRScheduler", "name", "piecewise", "lr_steps"),
                         ("LRScheduler", "gamma", gamma, "gamma"),
                         ("LRScheduler", "boundaries", sorted(steps), "lr_steps"))

    def set_optimizer(self, name):
        """`Optimizer.name`: sgd (with momentum) or adamw."""
        return self._set("Optimizer", "name", name, "optimizer")

    def set_val_targets(self, targets):
        """Verification packs `Eval.targets`: a list or a comma-separated string."""
        if isinstance(targets, str):
            targets = [t for t in targets.split(",") if t]
        elif isinstance(targets, tuple):
            targets = list(targets)
        return self._set("Eval", "targets", targets, "val_targets")

    def set_with_test(self, with_test):
        """Verify during training (needs val targets); False turns it off."""
        if not isinstance(with_test, bool):
            raise ValueError(f"with_test must be True or False, got {with_test!r}")
        return self if with_test else self._set("Eval", "targets", [], "with_test")

    def set_test_period(self, steps):
        """Steps between evaluations, `Eval.interval`."""
        return self._set("Eval", "interval", steps, "test_period")

    def set_mixed_precision(self, enable, dtype="float16"):
        """`AMP.enable` and `AMP.dtype` (float16 or bfloat16)."""
        return self._set_all(("AMP", "dtype", dtype, "mixed_precision dtype"),
                         ("AMP", "enable", enable, "mixed_precision enable"))

    def set_log_period(self, steps):
        """Steps between log lines, `Global.log_interval`."""
        return self._set("Global", "log_interval", steps, "log_period")

    def set_seed(self, seed):
        """Seed of initialisation, data order and sampling, `Global.seed`."""
        return self._set("Global", "seed", seed, "seed")

    def set_device(self, device):
        """`Global.device`: auto, cpu or gpu."""
        return self._set("Global", "device", device, "device")

    # ------------------------------------------------------------------ actions
    def get_config(self):
        """The validated config these settings make (ConfigError if incomplete)."""
        raw = copy.deepcopy(self._raw)
        if self._model is not None:
            raw.setdefault("Model", {}).setdefault("name", next(iter(MODELS)))
        return validate(raw, source="Entry")

    def train(self):
        """Train; returns the trainer's (step, loss) history."""
        from .train import Trainer
        return Trainer(self.get_config(), backbone=self._model).train()

    def test(self):
        """Verify the val targets with the checkpoint (or the latest one in model_save_dir)."""
        from .apps import evaluate
        return evaluate(self._trained_config(), backbone=self._model)

    def convert_for_prediction(self, output_dir=None, onnx=True):
        """Export the trained backbone; returns {'paddle': the inference prefix, 'onnx': the
        ONNX file or None, 'onnx_skipped': why not (`onnx` False, paddle2onnx missing) or None,
        'source': the checkpoint folder or weights file exported, 'step': its step or None}."""
        from .apps import export
        return export(self._trained_config(), output_dir, onnx, backbone=self._model)

    def predict(self, images, batch_size=None, flip=False):
        """Embeddings of images: HWC uint8 RGB arrays (a list or an [N, H, W, 3] array) or
        paths of image files, transformed as in evaluation."""
        from .data import DataError, FaceTransform
        from .apps import trained_backbone
        from .embedding import embed
        cfg = self._trained_config()
        model = self._predictor if getattr(self, "_predictor_cfg", None) == cfg else None
        if model is None:
            model = trained_backbone(cfg, self._model)
            self._predictor, self._predictor_cfg = model, cfg
        transform = FaceTransform(tuple(cfg["Data"]["image_size"]), train=False)
        arrays = []
        for item in images:
            if isinstance(item, str):
                with open(item, "rb") as f:  # a missing file: FileNotFoundError naming it
                    buf = f.read()
                try:
                    arrays.append(transform(buf))
                except DataError as err:  # not an image: name the file
                    raise DataError(f"{item}: {err}") from None
            else:
                arrays.append(transform.apply(np.asarray(item, dtype=np.uint8)))
        return embed(model, np.stack(arrays), batch_size or cfg["Eval"]["batch_size"], flip)

    def _trained_config(self):
        raw = copy.deepcopy(self._raw)
        g = raw.setdefault("Global", {})
        if not g.get("checkpoint") and not g.get("pretrained"):
            g["checkpoint"] = "latest"
        raw.setdefault("Loss", {}).setdefault("num_classes", 1)  # not needed to use a backbone
        raw.setdefault("Data", {}).setdefault("root", ".")
        if self._model is not None:
            raw.setdefault("Model", {}).setdefault("name", next(iter(MODELS)))
        try:
            return validate(raw, source="Entry")
        except ConfigError as err:
            raise ValueError(str(err)) from None
