"""Shared pieces of the engine tests: a small config and a backbone without batch statistics."""
import copy
import os

import paddle
from paddle import nn

from plsc.config import validate

IMAGE = 16
CLASSES = 24
GRAD_CLIP = 100.0


class FlatNet(nn.Layer):
    """Conv + MLP without batch statistics, so k ranks and one process compute alike."""

    def __init__(self, embedding_size=32):
        super().__init__()
        self.conv = nn.Conv2D(3, 8, 3, stride=2, padding=1)
        self.act = nn.PReLU()
        self.fc = nn.Linear(8 * (IMAGE // 2) ** 2, embedding_size)

    def forward(self, x):
        return self.fc(paddle.flatten(self.act(self.conv(x)), 1))


def make_backbone(seed=0):
    paddle.seed(seed)
    return FlatNet()


def config(data_root, output_dir, **sections):
    """A validated config over the synthetic set in `data_root`; `sections` update it."""
    raw = {
        "Global": {"seed": 0, "output_dir": output_dir, "device": "cpu", "max_steps": 6,
                   "log_interval": 1},
        "Model": {"name": "IResNetTiny", "embedding_size": 32},
        "Loss": {"margin": "arcface", "scale": 16.0, "num_classes": CLASSES},
        "Data": {"dataset": "synthetic", "root": data_root, "image_size": [IMAGE, IMAGE],
                 "batch_size": 4, "num_workers": 0,
                 "synthetic": {"num_identities": CLASSES, "images_per_identity": 6,
                               "num_val_identities": 8, "num_pairs": 40}},
        # The clip is set far above the backbone's gradient norm (15-23 on these batches), so
        # the clipping code runs but never rescales: a clip below the norm rescales every step to
        # the same norm and hides any uniform scale error (a missing unscale, a mean for a sum).
        "Optimizer": {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "grad_clip": GRAD_CLIP},
        "LRScheduler": {"warmup_steps": 2},
        "Checkpoint": {"interval": 3, "keep_last": 5},
        "Logging": {"visualdl": False, "progress_bar": False},
    }
    raw = copy.deepcopy(raw)
    for sec, values in sections.items():
        raw.setdefault(sec, {}).update(values)
    return validate(raw)


def make_data(root):
    """Generate the small synthetic set once (the engine would do it on first use too)."""
    from plsc.data.synthetic import generate
    if not os.path.isfile(os.path.join(root, "train.idx")):
        generate(root, image_size=IMAGE, num_identities=CLASSES, images_per_identity=6,
                 num_val_identities=8, num_pairs=40)
    return root
