"""A training run moved from insightface's arcface_torch to plsc: its per-rank checkpoints
(`checkpoint_gpu_{rank}.pt`, written by `train_v2.py` with `save_all_states`) made into a plsc
checkpoint that `Global.checkpoint` resumes, on any number of ranks.

What is carried over, from every rank's file (read without torch, `plsc.torchfile`):
- the backbone (`state_dict_backbone`, rank 0's; `plsc.models.from_insightface`);
- the class centres: rank r of k holds `C//k + (r < C%k)` classes from
  `r·(C//k) + min(r, C%k)` (`partial_fc_v2.py`), so the ranks' `state_dict_softmax_fc.weight`
  in rank order are all C centres; plsc writes them as one shard and re-shards on load;
- SGD momentum, where `state_optimizer` has it: the head's (its parameter group's one
  parameter) and the backbone's (the first group, in the order of the backbone's parameters).
  torch's SGD and plsc's keep the same velocity, v = μ·v + g + wd·w. Without it (another
  optimizer, or a file saved without the state) the velocity starts at zero and the caller
  is told so;
- the step (`global_step`) and the epochs done (`epoch`): the run goes on at the start of the
  next epoch, its LR schedule at that step.
Not carried over: the LR scheduler's own state (plsc's schedule is a function of the step), the
loss scaler (it starts fresh) and the random generators (the resumed run seeds anew).
"""
import os
import re

import numpy as np
import paddle

from ..config import ConfigError
from .layout import state_array, training_meta
from .manager import CheckpointManager

__all__ = ["import_arcface_torch", "arcface_torch_files"]

_RANK_FILE = re.compile(r"^checkpoint_gpu_(\d+)\.pt$")
_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
_KEYS = ("epoch", "global_step", "state_dict_backbone", "state_dict_softmax_fc")


def arcface_torch_files(folder):
    """The `checkpoint_gpu_{r}.pt` files of `folder` in rank order (all ranks 0..k-1)."""
    found = {}
    for name in os.listdir(folder):
        m = _RANK_FILE.match(name)
        if m:
            found[int(m.group(1))] = os.path.join(folder, name)
    if not found:
        raise FileNotFoundError(f"{folder} holds no checkpoint_gpu_<rank>.pt")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise FileNotFoundError(f"{folder} lacks checkpoint_gpu_{missing[0]}.pt (ranks 0 to "
                                f"{max(found)} are needed)")
    return [found[r] for r in sorted(found)]


def _read(files):
    from .. import torchfile
    states = []
    for file in files:
        state = torchfile.load(file)
        missing = [k for k in _KEYS if not isinstance(state, dict) or k not in state]
        if missing:
            raise ValueError(f"{file} is not an arcface_torch training checkpoint: it has no "
                             f"{missing[0]!r} (train_v2.py writes these with save_all_states)")
        states.append(state)
    steps = {int(s["global_step"]) for s in states}
    if len(steps) > 1:
        raise ValueError(f"the ranks' checkpoints are of different steps {sorted(steps)}: {files}")
    return states


def _centres(states, files, num_classes):
    """All classes' centres in class order, checking arcface_torch's split."""
    k = len(states)
    rows = []
    for r, (state, file) in enumerate(zip(states, files)):
        weight = np.asarray(state["state_dict_softmax_fc"].get("weight"))
        expect = num_classes // k + (r < num_classes % k)
        if weight.ndim != 2 or weight.shape[0] != expect:
            raise ValueError(f"{file}: state_dict_softmax_fc.weight has shape "
                             f"{list(weight.shape)}; rank {r} of {k} holds {expect} of "
                             f"Loss.num_classes={num_classes} classes in arcface_torch")
        rows.append(weight.astype(np.float32))
    return np.concatenate(rows)


def _momenta(state, count_backbone):
    """(the backbone's velocities in parameter order or None, the head's or None) of one rank's
    `state_optimizer` (SGD's `momentum_buffer`)."""
    opt = state.get("state_optimizer")
    if not isinstance(opt, dict) or "param_groups" not in opt:
        return None, None
    groups, buffers = opt["param_groups"], opt.get("state", {})

    def momentum(index):
        entry = buffers.get(index, {})
        return None if "momentum_buffer" not in entry else np.asarray(entry["momentum_buffer"])
    if len(groups) != 2 or len(groups[1]["params"]) != 1 or len(groups[0]["params"]) != count_backbone:
        return None, None
    head = momentum(groups[1]["params"][0])
    backbone = [momentum(i) for i in groups[0]["params"]]
    return backbone, head


def import_arcface_torch(files, cfg, backbone, log=print):
    """Write the plsc checkpoint of arcface_torch's `files` (`checkpoint_gpu_{r}.pt` of every
    rank, in rank order) under `cfg`'s `Global.output_dir/checkpoints`, for `cfg`'s head
    (Loss.num_classes; Loss.sub_centers 1) and `backbone` (the config's, built by the caller),
    whose weights are set from the files. Returns the checkpoint's folder."""
    from ..models import from_insightface, insightface_to_plsc
    if cfg["Loss"]["sub_centers"] != 1:
        raise ConfigError("Loss.sub_centers must be 1 to import arcface_torch (it has no "
                          "sub-centres)")
    states = _read(files)
    step, epoch = int(states[0]["global_step"]), int(states[0]["epoch"])
    num_classes = cfg["Loss"]["num_classes"]
    weight = _centres(states, files, num_classes)
    from_insightface(backbone, states[0]["state_dict_backbone"], source=files[0])
    if weight.shape[1] != backbone.embedding_size:
        raise ValueError(f"{files[0]}: the centres are {weight.shape[1]}-d, the backbone's "
                         f"embeddings {backbone.embedding_size}-d")

    torch_params = [k for k in states[0]["state_dict_backbone"]
                    if not k.endswith(_BUFFERS)]
    backbone_v, head_v = zip(*[_momenta(s, len(torch_params)) for s in states])
    sgd = cfg["Optimizer"]["name"] == "sgd"
    arrays = {"weight": weight}
    if sgd and all(v is not None for v in head_v):
        arrays[state_array("weight.velocity")] = np.concatenate(head_v).astype(np.float32)
    else:
        log(f"plsc: {files[0]}: no SGD momentum of the class centres to carry over"
            f"{'' if sgd else ' (Optimizer.name is not sgd)'}; it starts at zero")
    backbone_opt = {}
    if sgd and backbone_v[0] is not None:
        torch_state = {k: v for k, v in zip(torch_params, backbone_v[0]) if v is not None}
        trainable = {n for n, p in backbone.named_parameters() if not p.stop_gradient}
        for name, value in insightface_to_plsc(backbone, torch_state).items():
            if name in trainable:  # (a frozen parameter has no velocity)
                backbone_opt[f"@{name}_velocity_0"] = paddle.to_tensor(value)
    else:
        log(f"plsc: {files[0]}: no SGD momentum of the backbone to carry over; it starts at zero")
    meta = training_meta(epoch=epoch, batch_in_epoch=0, num_classes=num_classes,
                         embedding_size=int(weight.shape[1]), shard_size=num_classes,
                         sample_step=step, sub_centers=1, margin_state={},
                         head_arrays=arrays, model=cfg["Model"]["name"], config=cfg,
                         head_opt_step_count=step)
    meta["converted_from"] = {"arcface_torch": [os.path.abspath(f) for f in files]}
    manager = CheckpointManager(cfg["Global"]["output_dir"], keep_last=1 << 30)  # prunes none
    lr = {"last_epoch": step, "last_lr": 0.0}  # plsc's rate is a function of the step: resume sets it
    trainer_state = {"backbone_opt": dict(backbone_opt, LR_Scheduler=lr), "lr": lr}
    return manager.save(step, meta, backbone.state_dict(), trainer_state, arrays)
