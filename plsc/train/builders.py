"""Parts of a training run built from a validated config: the margin, the training set and
the two optimizers (the backbone's and the head's sparse one)."""
import os
import time

import paddle

from ..config import ConfigError
from ..distributed import barrier, get_rank
from ..loss import build_margin
from ..loss.table import margin_kwargs
from ..names import did_you_mean
from ..optim import SparseAdamW, SparseMomentum
from ..parts import open_dataset

__all__ = ["build_margin_from_config", "build_train_dataset", "class_count_note",
           "build_backbone_optimizer", "build_head_optimizer"]


def build_margin_from_config(loss):
    """The margin a validated `Loss` section asks for: its class and which key feeds which
    argument are the margins' table's (`plsc.loss.table`)."""
    name, kwargs = margin_kwargs(loss)
    return build_margin(name, **kwargs)


def _say(line):
    """A timestamped line on stdout: `build_train_dataset`'s default `say` (no log given)."""
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", flush=True)


def build_train_dataset(cfg, say=_say):
    """The training dataset of `cfg['Data']`; synthetic data are generated on first use (rank
    0 tells `say(line)`: the trainer's log). Loss.num_classes is compared with the data's class
    count (`class_count_note`): more classes in the data is a ConfigError naming both, found
    before synthetic data are generated; fewer is a warning line that rank 0 says."""
    d = cfg["Data"]
    kind, root = d["dataset"], d["root"]
    size = tuple(d["image_size"])
    flip = d["random_flip"]
    seed = cfg["Global"]["seed"]
    num_classes = cfg["Loss"]["num_classes"]
    if kind == "synthetic":
        identities = _synthetic_classes(d["synthetic"])  # its arguments checked, used or not
        if not os.path.isfile(os.path.join(root, "train.idx")):
            class_count_note(num_classes, *identities)  # before generating
            if get_rank() == 0:
                from ..data.synthetic import generate
                say(f"plsc: generating the synthetic data set under {root} (first use only)")
                start = time.perf_counter()
                made = generate(root, image_size=size[0], **d["synthetic"])
                say(f"plsc: {made['num_images']} training images of {made['num_classes']} "
                    f"identities and {made['num_pairs']} verification pairs written in "
                    f"{time.perf_counter() - start:.1f} s")
            barrier()
        kind = "recordio"
    ds, _ = open_dataset(kind, root, size, train=True, skip_bad=d["skip_bad"] > 0)
    note = class_count_note(num_classes, ds.data_classes, f"Data.root {root}: {ds.classes_from}")
    if note and get_rank() == 0:
        say(note)
    ds.num_classes = num_classes  # each label is checked against it as it is read
    ds.transform.flip_prob = 0.5 if flip else 0.0
    ds.transform.seed = int(seed)
    ds.transform.output = "uint8"  # normalised on the device by the trainer
    return ds


def _synthetic_classes(options):
    """(identities, where) that `Data.synthetic` asks the generator for; an argument it does
    not take is a ConfigError with the closest one."""
    import inspect
    from ..data.synthetic import generate
    params = inspect.signature(generate).parameters
    takes = [name for name in params if name not in ("out_dir", "image_size")]
    for key in options:
        if key not in takes:
            raise ConfigError(f"Data.synthetic: unknown argument {key!r}{did_you_mean(key, takes)}")
    if "num_identities" in options:
        return options["num_identities"], "Data.synthetic.num_identities"
    return params["num_identities"].default, "the synthetic generator's default num_identities"


def class_count_note(num_classes, data_classes, where):
    """Loss.num_classes against the class count the data declare (`where` says how it was
    read; None: unknown, nothing to compare): more classes in the data is a ConfigError naming
    both numbers and the -o that fits; fewer gives the warning line returned (else None)."""
    if data_classes is None or data_classes == num_classes:
        return None
    fix = f"-o Loss.num_classes={data_classes}"
    if data_classes > num_classes:
        raise ConfigError(f"Loss.num_classes={num_classes} is below the training data's "
                          f"{data_classes} classes ({where}); set {fix}")
    return (f"warning: Loss.num_classes={num_classes} but the training data have "
            f"{data_classes} classes ({where}): {num_classes - data_classes} classes get no "
            f"samples ({fix} to match)")


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
