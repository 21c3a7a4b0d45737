"""Parts of a training run built from a validated config."""
import os

import paddle

from .. import data as plsc_data
from ..config import ConfigError
from ..distributed import barrier, get_rank
from ..loss import build_margin
from ..optim import SparseAdamW, SparseMomentum
from ..runtime import keep_freed_memory, set_cpu_threads

__all__ = ["select_device", "build_backbone", "build_margin_from_config", "build_train_dataset",
           "build_backbone_optimizer", "build_head_optimizer"]

DATA_HELP = ("make a RecordIO set with `python tools/pack_rec.py --input IMAGE_DIR --output ROOT`, "
             "or try `configs/demo.yaml`, which generates synthetic identities")


def select_device(name, cpu_threads=None):
    """'auto' picks the GPU when Paddle has one, else the CPU. The threads of the CPU kernels
    follow `plsc.runtime.cpu_threads` (`cpu_threads`: Global.cpu_threads); on the CPU, malloc
    keeps freed memory for reuse (`plsc.runtime.keep_freed_memory`)."""
    has_gpu = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if name == "gpu" and not has_gpu:
        raise ConfigError("Global.device is gpu but this Paddle build sees no GPU")
    if name == "gpu" or (name == "auto" and has_gpu):
        paddle.set_device(f"gpu:{int(os.environ.get('FLAGS_selected_gpus', '0').split(',')[0])}")
    else:
        paddle.set_device("cpu")
        keep_freed_memory()
    set_cpu_threads(cpu_threads)
    return paddle.get_device()


def build_backbone(cfg):
    m = cfg["Model"]
    from ..models import build_model
    return build_model(m["name"], embedding_size=m["embedding_size"],
                       input_size=tuple(cfg["Data"]["image_size"]), dropout=m["dropout"])


def build_margin_from_config(loss):
    name = loss["margin"]
    s = float(loss["scale"])
    if name == "softmax":
        return build_margin("softmax")
    if name == "arcface":
        return build_margin("arcface", s=s, m=float(loss["m2"]), straight_through=loss["straight_through"])
    if name == "adaface":
        return build_margin("adaface", s=s, m=float(loss["adaface_m"]), h=float(loss["adaface_h"]),
                            t_alpha=float(loss["adaface_t_alpha"]))
    if name == "cosface":
        return build_margin("cosface", s=s, m=float(loss["m3"]))
    if name == "sphereface":
        return build_margin("sphereface", s=s, m=float(loss["m1"]),
                            straight_through=loss["straight_through"])
    return build_margin("combined", s=s, m1=float(loss["m1"]), m2=float(loss["m2"]),
                        m3=float(loss["m3"]), straight_through=loss["straight_through"])


def build_train_dataset(cfg):
    """The training dataset of `cfg['Data']`; synthetic data are generated on first use."""
    d = cfg["Data"]
    kind, root = d["dataset"], d["root"]
    size = tuple(d["image_size"])
    flip = d["random_flip"]
    seed = cfg["Global"]["seed"]
    if kind == "synthetic":
        if not os.path.isfile(os.path.join(root, "train.idx")):
            if get_rank() == 0:
                from ..data.synthetic import generate
                generate(root, image_size=size[0], **d["synthetic"])
            barrier()
        kind = "recordio"
    if not os.path.exists(root):
        raise ConfigError(f"Data.root {root} does not exist; {DATA_HELP}")
    common = dict(image_size=size, train=True, num_classes=cfg["Loss"]["num_classes"],
                  skip_bad=d["skip_bad"] > 0)
    if kind == "recordio":
        for name in ("train.rec", "train.idx"):
            if not os.path.isfile(os.path.join(root, name)):
                raise ConfigError(f"Data.root {root} has no {name}; {DATA_HELP}")
        ds = plsc_data.RecordIODataset(root, **common)
    elif kind == "folder":
        ds = plsc_data.ImageFolderDataset(root, **common)
    else:
        ds = plsc_data.ImageListDataset(root, **common)
    ds.transform.flip_prob = 0.5 if flip else 0.0
    ds.transform.seed = int(seed)
    ds.transform.output = "uint8"  # normalised on the device by the trainer
    return ds


def build_backbone_optimizer(cfg, params, lr):
    o = cfg["Optimizer"]
    clip = paddle.nn.ClipGradByGlobalNorm(o["grad_clip"]) if o["grad_clip"] else None
    if o["name"] == "sgd":
        return paddle.optimizer.Momentum(learning_rate=lr, momentum=o["momentum"], parameters=params,
                                         weight_decay=o["weight_decay"], grad_clip=clip)
    beta1, beta2 = o["betas"]
    return paddle.optimizer.AdamW(learning_rate=lr, beta1=beta1, beta2=beta2, parameters=params,
                                  weight_decay=o["weight_decay"], grad_clip=clip)


def build_head_optimizer(cfg, lr):
    o = cfg["Optimizer"]
    common = dict(state_dtype=o["head_state_dtype"], rounding=o["head_write_rounding"],
                  seed=cfg["Global"]["seed"])
    if o["name"] == "sgd":
        return SparseMomentum(lr, momentum=o["momentum"], weight_decay=o["weight_decay"], **common)
    beta1, beta2 = o["betas"]
    return SparseAdamW(lr, beta1=beta1, beta2=beta2, weight_decay=o["weight_decay"], **common)
