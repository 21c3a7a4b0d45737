"""`Entry`: the Python API PLSC's users know, over the same config and engine.

    from plsc import Entry
    ins = Entry()
    ins.set_model_name("IResNet50")
    ins.set_class_num(93431)
    ins.set_loss_type("dist_arcface")
    ins.set_dataset_dir("./train_data")
    ins.train()

Every setter writes one config key and checks the value at once (a bad value
raises ValueError); `train`, `test`, `convert_for_prediction` and `predict`
build the validated config and call the engine, exactly as the tools do.
"""
import copy
import numbers
import os

import numpy as np

from .config import ConfigError, SCHEMA, apply_overrides, load_config, validate
from .models import MODELS, resolve_name
from .numerics import STORAGE_DTYPES

__all__ = ["Entry", "LOSS_TYPES"]

# PLSC's loss types -> (margin, scale, m1, m2, m3). The dist_ and plain variants are the same
# here: every head is class-sharded, and one rank is simply a world of size one.
LOSS_TYPES = {
    "dist_arcface": ("arcface", 64.0, 1.0, 0.5, 0.0), "arcface": ("arcface", 64.0, 1.0, 0.5, 0.0),
    "dist_cosface": ("cosface", 64.0, 1.0, 0.0, 0.4), "cosface": ("cosface", 64.0, 1.0, 0.0, 0.4),
    "dist_softmax": ("softmax", 1.0, 1.0, 0.0, 0.0), "softmax": ("softmax", 1.0, 1.0, 0.0, 0.0),
}


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _positive_number(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


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

    def _set(self, section, key, value):
        self._raw.setdefault(section, {})[key] = value
        return self

    # ---------------------------------------------------------------- setters
    def set_model_name(self, name):
        try:
            return self._set("Model", "name", resolve_name(name))
        except ValueError as err:
            raise ValueError(f"set_model_name: {err}") from None

    def set_model(self, model):
        """Use a `paddle.nn.Layer` as the backbone instead of a registered name."""
        import paddle
        if not isinstance(model, paddle.nn.Layer):
            raise ValueError(f"set_model needs a paddle.nn.Layer, got {type(model).__name__}")
        self._model = model
        return self

    def set_class_num(self, num):
        return self._set("Loss", "num_classes", _positive_int("class_num", num))

    def set_emb_size(self, size):
        return self._set("Model", "embedding_size", _positive_int("emb_size", size))

    def set_loss_type(self, loss_type):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
        margin, s, m1, m2, m3 = LOSS_TYPES[loss_type]
        for key, value in (("margin", margin), ("scale", s), ("m1", m1), ("m2", m2), ("m3", m3)):
            self._set("Loss", key, value)
        return self

    def set_margin(self, scale=None, m1=None, m2=None, m3=None):
        for key, value in (("scale", scale), ("m1", m1), ("m2", m2), ("m3", m3)):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise ValueError(f"margin {key} must be a number, got {value!r}")
                self._set("Loss", key, float(value))
        return self

    def set_adaface(self, scale=None, m=None, h=None, t_alpha=None):
        """Train with the AdaFace margin (defaults: s=64, m=0.4, h=0.333, t_alpha=0.01)."""
        self._set("Loss", "margin", "adaface")
        for key, value in (("scale", scale), ("adaface_m", m), ("adaface_h", h),
                           ("adaface_t_alpha", t_alpha)):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise ValueError(f"AdaFace {key} must be a number, got {value!r}")
                self._set("Loss", key, float(value))
        return self

    def set_sub_centers(self, k):
        """K centres per class (sub-center ArcFace); 1 turns them off."""
        return self._set("Loss", "sub_centers", _positive_int("sub_centers", k))

    def set_sample_ratio(self, ratio):
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 < ratio <= 1:
            raise ValueError(f"sample_ratio must be in (0, 1], got {ratio!r}")
        return self._set("Loss", "sample_ratio", float(ratio))

    def set_chunk_size(self, chunk_size=None, logits_budget_mb=None):
        """Logit-free head: classes per block (None: automatic from the budget; 0: dense)."""
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(
                chunk_size, numbers.Integral) or chunk_size < 0):
            raise ValueError(f"chunk_size must be None, 0 or a positive integer, got {chunk_size!r}")
        self._set("Loss", "chunk_size", None if chunk_size is None else int(chunk_size))
        if logits_budget_mb is not None:
            self._set("Loss", "logits_budget_mb", _positive_number("logits_budget_mb", logits_budget_mb))
        return self

    def set_param_dtype(self, dtype, state_dtype=None, rounding=None):
        """Storage of the class centres (and, `state_dtype`, of their optimizer state; None:
        the centres' dtype): "float32", "bfloat16" or "float16". `rounding` of 16-bit writes:
        "stochastic" (default) or "nearest"."""
        for name, value in (("dtype", dtype), ("state_dtype", state_dtype)):
            if value not in STORAGE_DTYPES and (name == "dtype" or value is not None):
                raise ValueError(f"{name} must be one of {', '.join(STORAGE_DTYPES)}, got {value!r}")
        if rounding is not None and rounding not in ("stochastic", "nearest"):
            raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
        self._set("Loss", "param_dtype", dtype)
        self._set("Optimizer", "head_state_dtype", state_dtype)
        if rounding is not None:
            self._set("Optimizer", "head_write_rounding", rounding)
        return self

    def set_fused_head_update(self, enable):
        """Update the head inside its backward where exact (default True)."""
        if not isinstance(enable, bool):
            raise ValueError(f"fused_head_update must be True or False, got {enable!r}")
        return self._set("Optimizer", "fused_head_update", enable)

    def set_train_batch_size(self, size):
        return self._set("Data", "batch_size", _positive_int("train_batch_size", size))

    def set_test_batch_size(self, size):
        return self._set("Eval", "batch_size", _positive_int("test_batch_size", size))

    def set_dataset_dir(self, path):
        """Training data: a folder with train.rec/train.idx (and the verification packs)."""
        if not isinstance(path, str) or not path:
            raise ValueError(f"dataset_dir must be a path, got {path!r}")
        self._set("Data", "root", path)
        self._raw.setdefault("Eval", {}).setdefault("root", path)
        return self

    def set_dataset_type(self, kind):
        choices = SCHEMA["Data"]["dataset"].choices
        if kind not in choices:
            raise ValueError(f"dataset_type must be one of {', '.join(choices)}, got {kind!r}")
        return self._set("Data", "dataset", kind)

    def set_image_size(self, height, width=None):
        return self._set("Data", "image_size", [_positive_int("image height", height),
                                                _positive_int("image width", width or height)])

    def set_model_save_dir(self, path):
        if not isinstance(path, str) or not path:
            raise ValueError(f"model_save_dir must be a path, got {path!r}")
        return self._set("Global", "output_dir", path)

    def set_checkpoint_dir(self, path):
        """Resume from (or evaluate) a checkpoint folder, or 'latest' in model_save_dir."""
        if not isinstance(path, str) or not (path == "latest" or os.path.isdir(path)):
            raise ValueError(f"checkpoint_dir must be an existing checkpoint folder or 'latest', "
                             f"got {path!r}")
        return self._set("Global", "checkpoint", path)

    def set_train_epochs(self, epochs):
        self._set("Global", "max_steps", None)
        return self._set("Global", "epochs", _positive_int("train_epochs", epochs))

    def set_train_steps(self, steps):
        return self._set("Global", "max_steps", _positive_int("train_steps", steps))

    def set_warmup_epochs(self, epochs):
        if isinstance(epochs, bool) or not isinstance(epochs, numbers.Real) or epochs < 0:
            raise ValueError(f"warmup_epochs must be a number >= 0, got {epochs!r}")
        return self._set("LRScheduler", "warmup_epochs", float(epochs))

    def set_lr(self, lr):
        return self._set("Optimizer", "lr", _positive_number("lr", lr))

    def set_lr_steps(self, boundaries, gamma=0.1):
        """Piecewise decay: multiply the rate by `gamma` at each epoch in `boundaries`."""
        if not isinstance(boundaries, (list, tuple)) or not all(
                isinstance(b, numbers.Integral) and b > 0 for b in boundaries):
            raise ValueError(f"lr_steps must be a list of positive epoch numbers, got {boundaries!r}")
        self._set("LRScheduler", "name", "piecewise")
        self._set("LRScheduler", "gamma", _positive_number("gamma", gamma))
        return self._set("LRScheduler", "boundaries", sorted(int(b) for b in boundaries))

    def set_optimizer(self, name):
        if name not in ("sgd", "adamw"):
            raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {name!r}")
        return self._set("Optimizer", "name", name)

    def set_val_targets(self, targets):
        if isinstance(targets, str):
            targets = [t for t in targets.split(",") if t]
        if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"val_targets must be names like ['lfw', 'cfp_fp'], got {targets!r}")
        return self._set("Eval", "targets", list(targets))

    def set_with_test(self, with_test):
        """Verify during training (needs val targets); False turns it off."""
        if not isinstance(with_test, bool):
            raise ValueError(f"with_test must be True or False, got {with_test!r}")
        if not with_test:
            self._set("Eval", "targets", [])
        return self

    def set_test_period(self, steps):
        return self._set("Eval", "interval", _positive_int("test_period", steps))

    def set_mixed_precision(self, enable, dtype="float16"):
        if not isinstance(enable, bool) or dtype not in ("float16", "bfloat16"):
            raise ValueError(f"mixed_precision needs (True|False, 'float16'|'bfloat16'), got "
                             f"({enable!r}, {dtype!r})")
        self._set("AMP", "dtype", dtype)
        return self._set("AMP", "enable", enable)

    def set_log_period(self, steps):
        return self._set("Global", "log_interval", _positive_int("log_period", steps))

    def set_seed(self, seed):
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        return self._set("Global", "seed", int(seed))

    def set_device(self, device):
        if device not in ("auto", "cpu", "gpu"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'gpu', got {device!r}")
        return self._set("Global", "device", device)

    # ------------------------------------------------------------------ actions
    def get_config(self):
        """The validated config these settings make (ConfigError if incomplete)."""
        raw = copy.deepcopy(self._raw)
        if self._model is not None:
            raw.setdefault("Model", {}).setdefault("name", next(iter(MODELS)))
        return validate(raw, source="Entry")

    def train(self):
        """Train; returns the trainer's (step, loss) history."""
        from .engine import Trainer
        return Trainer(self.get_config(), backbone=self._model).train()

    def test(self):
        """Verify the val targets with the checkpoint (or the latest one in model_save_dir)."""
        from .engine.tasks import evaluate
        return evaluate(self._trained_config(), backbone=self._model)

    def convert_for_prediction(self, output_dir=None, onnx=True):
        """Export the trained backbone; returns {'paddle': prefix, 'onnx': path}."""
        from .engine.tasks import export
        return export(self._trained_config(), output_dir, onnx, backbone=self._model)

    def predict(self, images, batch_size=None, flip=False):
        """Embeddings of images: HWC uint8 RGB arrays (a list or an [N, H, W, 3] array) or
        paths of image files, transformed as in evaluation."""
        from .data import FaceTransform
        from .engine.tasks import embed, trained_backbone
        cfg = self._trained_config()
        model = self._predictor if getattr(self, "_predictor_cfg", None) == cfg else None
        if model is None:
            model = trained_backbone(cfg, self._model)
            self._predictor, self._predictor_cfg = model, cfg
        transform = FaceTransform(tuple(cfg["Data"]["image_size"]), train=False)
        arrays = []
        for item in images:
            if isinstance(item, str):
                with open(item, "rb") as f:
                    arrays.append(transform(f.read()))
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
