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


def checked_closing_block(out, step, how, checkpoint_step=None):
    """The closing block that ends `out`/train.log, checked against the disk and the log's
    other lines: its first line says the run ended at `step` (None: any) and how (`how`
    starts the parenthesis); the checkpoint it names is the newest complete folder under
    `out`/checkpoints (listed here), of `checkpoint_step` when given, and its step is that
    folder's meta.json's; the best accuracy is the highest the log printed after step 0, or
    "no evaluation" when it printed none; the export command names out/config.yaml (on disk)
    and the checkpoint. Returns the checkpoint's folder (None: none)."""
    import json
    import re
    lines = [line.split(" ", 2)[2] for line in open(os.path.join(out, "train.log"))]
    starts = [i for i, line in enumerate(lines) if line.startswith("run ended at step ")]
    assert starts, lines[-10:]
    block = lines[starts[-1]:]
    first = re.match(r"run ended at step (\d+) of \d+ \((.*)\); wall time \d+:\d\d:\d\d "
                     r"\((\d+\.\d) s\)$", block[0].rstrip("\n"))
    assert first, block[0]
    assert step is None or int(first.group(1)) == step, block[0]
    assert first.group(2).startswith(how), block[0]
    root = os.path.join(out, "checkpoints")
    complete = sorted(d for d in os.listdir(root) if re.fullmatch(r"step_\d{8}", d)
                      and os.path.isfile(os.path.join(root, d, "meta.json")))
    found = re.fullmatch(r"  last complete checkpoint: (\S+) \(step (\d+)\)\n", block[1])
    if not complete:
        assert block[1].startswith("  last complete checkpoint: none"), block
        return None
    assert found, block
    path = found.group(1)
    assert path == os.path.join(root, complete[-1]), (block[1], complete)
    with open(os.path.join(path, "meta.json")) as f:
        assert int(found.group(2)) == json.load(f)["step"], block[1]
    assert checkpoint_step is None or int(found.group(2)) == checkpoint_step, block[1]
    begun = max(i for i, line in enumerate(lines[:starts[-1]]) if " rank(s) on " in line)
    printed = {}  # target -> {step: accuracy} of this run's evaluations after step 0
    for line in lines[begun:starts[-1]]:
        acc = re.match(r"\[(\w+)\] step (\d+) accuracy (\d\.\d{4}) ", line)
        if acc and int(acc.group(2)) > 0:
            printed.setdefault(acc.group(1), {})[int(acc.group(2))] = acc.group(3)
    best = block[2].rstrip("\n")
    if not printed:
        assert best.startswith("  best held-out accuracy: no evaluation"), best
    for target, values in printed.items():
        top = max(values.values(), key=float)
        said = re.search(rf"{target} (\d\.\d{{4}}) at step (\d+) \(its backbone: (\S+)\)", best)
        assert said and said.group(1) == top, (best, values)
        assert values[int(said.group(2))] == top, (best, values)  # a step that printed it
        assert said.group(3) == os.path.join(out, "best_" + target), best
        with open(os.path.join(said.group(3), "best.json")) as f:
            assert json.load(f)["step"] == int(said.group(2)), best
    config = os.path.join(out, "config.yaml")
    assert os.path.isfile(config)
    assert block[3:] == [f"  export it: python tools/export.py -c {config} "
                         f"-o Global.checkpoint={path}\n"], block
    return path
