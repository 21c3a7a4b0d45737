"""Shared pieces of the trainer tests: a small config and a backbone without batch statistics."""
import copy
import glob
import os

import numpy as np
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
    """Generate the small synthetic set once (the trainer would do it on first use too)."""
    from plsc.data.synthetic import generate
    if not os.path.isfile(os.path.join(root, "train.idx")):
        generate(root, image_size=IMAGE, num_identities=CLASSES, images_per_identity=6,
                 num_val_identities=8, num_pairs=40)
    return root


def bits(t):
    """A tensor's raw bits as an unsigned integer array (bfloat16's .numpy() is its uint16
    bits already), so that comparisons are bit for bit (-0.0 != 0.0, NaN == NaN)."""
    a = np.array(t.numpy())
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def head_bits(trainer):
    """{name: bits} of the head's weight, bias and every optimizer state array (8-bit ones as
    `<name>.codes` and `<name>.scale`), and the optimizer's step count."""
    arrays = {"weight": trainer.head.weight}
    if trainer.head.bias is not None:
        arrays["bias"] = trainer.head.bias
    for key, value in trainer.head_opt.state_dict().items():
        if key != "step_count":
            arrays[f"opt.{key}"] = value
    out = {}
    for name, t in arrays.items():
        if hasattr(t, "codes"):  # plsc.storage.int8.Int8Rows
            out[name + ".codes"], out[name + ".scale"] = bits(t.codes), bits(t.scale)
        else:
            out[name] = bits(t)
    return out, trainer.head_opt.step_count


def backbone_bits(trainer):
    return {n: bits(p) for n, p in trainer.backbone.named_parameters()}


def assert_same_bits(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def checkpoint_state(out, step):
    """Backbone and every head array of checkpoint `step` under run folder `out`, as stored
    ({name: numpy array}; head arrays by their path in the checkpoint)."""
    ckpt = os.path.join(out, "checkpoints", f"step_{step:08d}")
    state = {k: v.numpy() for k, v in paddle.load(os.path.join(ckpt, "backbone.pdparams")).items()}
    for f in sorted(glob.glob(os.path.join(ckpt, "head_rank*", "*.npy"))):
        state[os.path.relpath(f, ckpt)] = np.load(f)
    return state
