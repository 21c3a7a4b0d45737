"""A training run moved from arcface_torch to plsc: checkpoint_gpu_{r}.pt files of 3 ranks, in
arcface_torch's layout (the class split of its partial_fc_v2.py, torch SGD's optimizer state),
written with plsc's torch-format writer, become a plsc checkpoint that 2 gloo ranks resume and
train on. The expected rows come from the arrays the test wrote, in arcface_torch's split."""
import os
from collections import OrderedDict

import numpy as np
import paddle
import pytest

from trainer_common import CLASSES, config, make_data
from plsc import torchfile
from plsc.checkpoint import load_head_rows, read_meta
from plsc.checkpoint.arcface_torch import _centres, arcface_torch_files, import_arcface_torch
from plsc.models import plsc_to_insightface
from plsc.parts import build_backbone

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS, STEP, EPOCH = 3, 3, 1
_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def arcface_split(num_classes, k):
    """(start, count) of each rank's classes in arcface_torch's partial_fc_v2.py."""
    return [(num_classes // k * r + min(r, num_classes % k), num_classes // k + (r < num_classes % k))
            for r in range(k)]


def write_checkpoints(folder, backbone_state, centres, head_v, backbone_v):
    """checkpoint_gpu_{r}.pt of RANKS ranks as train_v2.py saves them (SGD, save_all_states)."""
    params = [k for k in backbone_state if not k.endswith(_BUFFERS)]
    n = len(params)
    for r, (start, count) in enumerate(arcface_split(len(centres), RANKS)):
        state = OrderedDict((i, {"momentum_buffer": backbone_v[k]}) for i, k in enumerate(params)
                            if k in backbone_v)
        state[n] = {"momentum_buffer": head_v[start:start + count]}
        groups = [{"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "params": list(range(n))},
                  {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "params": [n]}]
        torchfile.save({"epoch": EPOCH, "global_step": STEP,
                        "state_dict_backbone": backbone_state,
                        "state_dict_softmax_fc": OrderedDict(weight=centres[start:start + count]),
                        "state_optimizer": {"state": state, "param_groups": groups},
                        "state_lr_scheduler": {"last_epoch": STEP}},
                       os.path.join(folder, f"checkpoint_gpu_{r}.pt"))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(data root, the arcface_torch folder, the imported checkpoint, the arrays written)."""
    data = make_data(str(tmp_path_factory.getbasetemp() / "trainer_data"))
    folder = str(tmp_path_factory.mktemp("arcface_torch"))
    cfg = config(data, str(tmp_path_factory.mktemp("plsc")))
    paddle.seed(11)
    source = build_backbone(cfg)
    backbone_state = plsc_to_insightface(source)  # arcface_torch's keys and [out, in] Linears
    rng = np.random.RandomState(5)
    centres = rng.standard_normal((CLASSES, 32)).astype(np.float32)
    head_v = rng.standard_normal((CLASSES, 32)).astype(np.float32)
    backbone_v = {k: rng.standard_normal(v.shape).astype(np.float32)  # arcface_torch's
                  for k, v in backbone_state.items()  # features.weight is frozen: no momentum
                  if not k.endswith(_BUFFERS) and k != "features.weight"}
    write_checkpoints(folder, backbone_state, centres, head_v, backbone_v)
    notes = []
    path = import_arcface_torch(arcface_torch_files(folder), cfg, build_backbone(cfg),
                                log=notes.append)
    return dict(data=data, folder=folder, path=path, cfg=cfg, source=source, centres=centres,
                head_v=head_v, backbone_v=backbone_v, notes=notes)


def test_arcface_split_is_read_in_rank_order():
    """25 classes on 3 ranks: 9, 8, 8 (rank r < C % k holds one more)."""
    rows = np.arange(25 * 2, dtype=np.float32).reshape(25, 2)
    states = [{"state_dict_softmax_fc": {"weight": rows[s:s + c]}} for s, c in arcface_split(25, 3)]
    assert [c for _, c in arcface_split(25, 3)] == [9, 8, 8]
    np.testing.assert_array_equal(_centres(states, ["a", "b", "c"], 25), rows)
    with pytest.raises(ValueError, match="rank 0 of 3 holds 9 of Loss.num_classes=25"):
        _centres([{"state_dict_softmax_fc": {"weight": rows[:8]}}] + states[1:], ["a", "b", "c"], 25)


def test_import_writes_every_class_its_momentum_and_the_step(imported):
    path = imported["path"]
    meta = read_meta(path)
    assert meta["step"] == STEP and meta["epoch"] == EPOCH and meta["batch_in_epoch"] == 0
    np.testing.assert_array_equal(load_head_rows(path, "weight", 0, CLASSES, meta),
                                  imported["centres"])
    np.testing.assert_array_equal(load_head_rows(path, "opt.weight.velocity", 0, CLASSES, meta),
                                  imported["head_v"])
    state = paddle.load(os.path.join(path, "backbone.pdparams"))
    for name, value in imported["source"].state_dict().items():
        np.testing.assert_array_equal(state[name].numpy(), value.numpy(), err_msg=name)
    # torch's momentum of a Linear weight is [out, in]; Paddle's velocity is [in, out]
    opt = paddle.load(os.path.join(path, "trainer.pdstates"))["backbone_opt"]
    np.testing.assert_array_equal(opt["@fc.weight_velocity_0"].numpy(),
                                  imported["backbone_v"]["fc.weight"].T)
    np.testing.assert_array_equal(opt["@layer1.0.conv1.weight_velocity_0"].numpy(),
                                  imported["backbone_v"]["layer1.0.conv1.weight"])
    assert not imported["notes"]


def test_two_ranks_resume_the_imported_run_and_train_on(imported, run_ranks):
    """The 3-rank arcface_torch checkpoint, resumed on 2 plsc ranks: each rank holds its
    classes' rows and momentum, the step goes on from the file's, and training runs."""
    out = os.path.dirname(os.path.dirname(imported["path"]))
    done = run_ranks(os.path.join(HERE, "trainer_ranks.py"), 2,
                     ["--mode", "resume", "--data", imported["data"], "--out", out,
                      "--config-backbone", "--resume", f"at=float32:{imported['path']}"],
                     cwd=out, timeout=600)
    assert done.status == 0 and done.reports[0], done.tail()
    got = done.reports[0]
    assert int(got["at.step"]) == STEP and int(got["at.num_local"]) == CLASSES // 2
    np.testing.assert_array_equal(got["at.head"], imported["centres"])
    np.testing.assert_array_equal(got["at.velocity"], imported["head_v"])
    for name, value in imported["source"].named_parameters():
        np.testing.assert_array_equal(got[f"at.backbone.{name}"], value.numpy(), err_msg=name)
    assert np.isfinite(got["at.losses"]).all() and len(got["at.losses"]) > 0
    assert not np.array_equal(got["at.after"], imported["centres"])  # the centres trained on
