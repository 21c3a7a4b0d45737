"""What a config names that training (`plsc.train`) and the applications (`plsc.apps`) both
build: the backbone (`build_backbone`), its pretrained weights (`load_pretrained`) and a data
set (`open_dataset`). One floor below both packages, so that neither imports the other."""
import os

from . import data
from .checkpoint import load_paddle_file
from .config import ConfigError
from .loading import load_strict
from .models import build_model, model_options, set_unbiased_var
from .models.insightface import from_insightface, is_torch_file

__all__ = ["build_backbone", "load_pretrained", "open_dataset", "DATA_HELP"]

DATA_HELP = ("make a RecordIO set with `python tools/pack_rec.py --input IMAGE_DIR --output ROOT`, "
             "or try `configs/demo.yaml`, which generates synthetic identities")
_SOURCES = ("recordio", "folder", "list")


def build_backbone(cfg):
    """The backbone of `cfg['Model']` for `cfg['Data']['image_size']` images. The keys only some
    backbones have (`Model.drop_path_rate`, `mask_ratio`, `patch_size`, `recompute`) override
    the name's values when set; set for a backbone without them, they are a ConfigError naming
    the key. Model.bn_unbiased_var sets how its BatchNorms update their running variance."""
    m = cfg["Model"]
    options = {key: m[key] for key in ("drop_path_rate", "mask_ratio", "patch_size", "recompute")
               if m.get(key) is not None}
    for key, value in options.items():
        if key not in model_options(m["name"]):
            raise ConfigError(f"Model.{key}={value!r}: {m['name']} has no {key} (only "
                              f"{'IResNets and ' if key == 'recompute' else ''}ViTs have it); "
                              "leave it null")
    backbone = build_model(m["name"], embedding_size=m["embedding_size"],
                           input_size=tuple(cfg["Data"]["image_size"]), dropout=m["dropout"],
                           **options)
    set_unbiased_var(backbone, m["bn_unbiased_var"])
    return backbone


def load_pretrained(backbone, path):
    """Global.pretrained: set `backbone`'s weights from a plsc `.pdparams` file, or from an
    arcface_torch file (torch's format: a `.pt`/`.pth` name or a zip archive), read without
    torch by `plsc.models.from_insightface`, which checks every key and shape. A `.pdparams`
    is loaded by `plsc.loading.load_strict`: every tensor with the model's shape, nothing
    else, or nothing at all. A mismatch is a ConfigError of one line naming the tensors.
    Returns `path`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Global.pretrained: no file {path}")
    if is_torch_file(path):
        try:
            from_insightface(backbone, path)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"Global.pretrained: {err}") from None
    else:
        load_strict(backbone, load_paddle_file(path), path)
    return path


def _source_kind(root):
    """recordio, folder or list: what `root` is (a folder with train.idx, a folder, a file)."""
    if os.path.isdir(root):
        return "recordio" if os.path.isfile(os.path.join(root, "train.idx")) else "folder"
    if os.path.isfile(root):
        return "list"
    raise FileNotFoundError(f"{root} is neither a RecordIO folder, an image folder nor a list file")


def open_dataset(kind, root, image_size, train, what="Data.root", **options):
    """(dataset, kind) for the images at `root`: `kind` is Data.dataset (recordio, folder,
    list; synthetic, once generated, is read as recordio) or "auto" (from what `root` is).
    `train`: with the training transform (else the image alone, in order); `options` go to
    the dataset (num_classes, skip_bad). A missing `root` or RecordIO file is a ConfigError
    naming `what`."""
    kind = _source_kind(root) if kind == "auto" else ("recordio" if kind == "synthetic" else kind)
    if kind not in _SOURCES:
        raise ConfigError(f"Data.dataset must be one of {_SOURCES + ('synthetic',)}, got {kind!r}")
    if not os.path.exists(root):
        raise ConfigError(f"{what} {root} does not exist; {DATA_HELP}")
    if kind == "recordio":
        for name in ("train.rec", "train.idx"):
            if not os.path.isfile(os.path.join(root, name)):
                raise ConfigError(f"{what} {root} has no {name}; {DATA_HELP}")
    cls = {"recordio": data.RecordIODataset, "folder": data.ImageFolderDataset,
           "list": data.ImageListDataset}[kind]
    return cls(root, image_size=tuple(image_size), train=train, **options), kind
