"""A loss or gradient that is not finite: the step is skipped on every part (backbone, head and
both optimizers' state keep their bits), a resume across such a step equals the uninterrupted
run, a run that stays non-finite stops with status 70 naming the last finite checkpoint, no
checkpoint holds a non-finite array, and the float16 scaler's skips count only at its floor."""
import glob
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest
from paddle import nn

from trainer_common import (CLASSES, IMAGE, assert_same_bits, backbone_bits, bits,
                            checked_closing_block, config, head_bits, make_backbone, make_data)
from plsc.config import dump_config
from plsc.train import Trainer
from plsc.train.amp import LossScaler
from plsc.train.divergence import DIVERGED_EXIT_CODE, Diverged

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(os.path.dirname(HERE), "tools", "train.py")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("synthetic")))


class Poisoned(nn.Layer):
    """FlatNet whose embeddings are NaN in the training steps `nan_steps` (1-based, read from
    the trainer it is given), or whose embeddings' gradient is infinite while `grad_poison`."""

    def __init__(self, nan_steps=()):
        super().__init__()
        self.net = make_backbone(0)
        self.nan_steps, self.grad_poison, self.trainer = set(nan_steps), False, None

    def forward(self, x):
        emb = self.net(x)
        if self.training and self.trainer is not None and self.trainer.step + 1 in self.nan_steps:
            emb = emb * float("nan")
        if self.grad_poison:
            emb.register_hook(lambda g: g * float("inf"))
        return emb


def trainer_with(tmp_path, data_root, name, backbone, **sections):
    trainer = Trainer(config(data_root, str(tmp_path / name), **sections), backbone=backbone)
    backbone.trainer = trainer
    return trainer


def backbone_opt_bits(trainer):
    return {k: bits(v) for k, v in trainer.backbone_opt.state_dict().items()
            if isinstance(v, paddle.Tensor)}


def batches(n, seed=7):
    rng = np.random.RandomState(seed)
    return [(paddle.to_tensor(rng.normal(size=(4, 3, IMAGE, IMAGE)).astype("float32")),
             paddle.to_tensor(rng.randint(0, CLASSES, 4).astype("int64"))) for _ in range(n)]


@pytest.mark.parametrize("dtype,ratio,fused,accumulate", [
    ("float32", 1.0, True, 1), ("bfloat16", 0.5, True, 1), ("float32", 0.5, False, 1),
    ("int8", 1.0, False, 2)])
def test_nan_loss_skips_the_whole_step(tmp_path, data_root, dtype, ratio, fused, accumulate):
    """Step 2's embeddings are NaN (so is its loss): nothing changes, the step count and the
    learning rate move on, the next step trains. Fused (head rows updated inside the backward)
    and separate updates, accumulation, 16- and 8-bit rows."""
    backbone = Poisoned(nan_steps={2})
    trainer = trainer_with(tmp_path, data_root, "run", backbone,
                           Loss={"param_dtype": dtype, "sample_ratio": ratio},
                           Optimizer={"fused_head_update": fused, "accumulate_steps": accumulate})
    assert trainer.fused_head_update == (fused and accumulate == 1)
    data = batches(3 * accumulate)
    micro = [data[i * accumulate:(i + 1) * accumulate] for i in range(3)]
    first = trainer.train_step(micro[0])
    assert np.isfinite(first) and trainer.nonfinite.run == 0
    head0, count0 = head_bits(trainer)
    backbone0, opt0 = backbone_bits(trainer), backbone_opt_bits(trainer)
    assert opt0 and any(v.any() for v in opt0.values())  # momentum exists: the check can fail
    schedule0 = trainer.lr.last_epoch
    loss = trainer.train_step(micro[1])
    assert np.isnan(loss) and trainer.step == 2 and trainer.nonfinite.run == 1
    head1, count1 = head_bits(trainer)
    assert_same_bits(head1, head0)
    assert count1 == count0
    assert_same_bits(backbone_bits(trainer), backbone0)
    assert_same_bits(backbone_opt_bits(trainer), opt0)
    assert trainer.lr.last_epoch == schedule0 + 1  # the schedule moves on, as for a float16 skip
    assert np.isfinite(trainer.train_step(micro[2])) and trainer.nonfinite.run == 0
    head2, count2 = head_bits(trainer)
    assert count2 == count0 + 1  # an applied step advances the count
    assert not np.array_equal(head2["weight" if dtype != "int8" else "weight.codes"],
                              head0["weight" if dtype != "int8" else "weight.codes"])
    assert any(not np.array_equal(v, backbone0[k]) for k, v in backbone_bits(trainer).items())


def test_infinite_gradient_with_a_finite_loss(tmp_path, data_root):
    """Only the embeddings' gradient is infinite (the loss is finite). With the separate head
    update the whole step is skipped; with the fused one the head's rows were already updated
    in the backward (their gradients are finite) and only the backbone's update is skipped,
    as docs/faults.md says."""
    for fused in (False, True):
        backbone = Poisoned()
        trainer = trainer_with(tmp_path, data_root, f"grad{fused}", backbone,
                               Optimizer={"fused_head_update": fused})
        data = batches(2, seed=11)
        trainer.train_step([data[0]])
        head0, count0 = head_bits(trainer)
        backbone0, opt0 = backbone_bits(trainer), backbone_opt_bits(trainer)
        backbone.grad_poison = True
        assert np.isfinite(trainer.train_step([data[1]]))
        assert trainer.nonfinite.run == 1
        assert_same_bits(backbone_bits(trainer), backbone0)
        assert_same_bits(backbone_opt_bits(trainer), opt0)
        head1, _ = head_bits(trainer)
        if fused:
            assert not np.array_equal(head1["weight"], head0["weight"])
        else:
            assert_same_bits(head1, head0)


@pytest.mark.parametrize("amp", [False, True])
def test_resume_across_a_skipped_step_equals_the_uninterrupted_run(tmp_path, data_root, amp):
    """Step 5's loss is NaN: skipped, the run goes on, and a run resumed from step 3 repeats
    it bit for bit. `amp`: with the float16 loss scaler on (enabled after construction, as
    the trainer refuses AMP on the CPU; the resumed run's scaler state comes from the
    checkpoint), whose skip halves the scale."""
    def make(name, **global_):
        trainer = trainer_with(tmp_path, data_root, name, Poisoned(nan_steps={5}),
                               Global=global_, Loss={"sample_ratio": 0.5})
        if amp:
            if "checkpoint" in global_:
                trainer.scaler.enabled = True  # its scale, steps and skips were resumed
                trainer.scaler.growth_interval = 2  # (a setting, not state)
            else:
                trainer.scaler = LossScaler(True, init_scale=1024.0, growth_interval=2)
        return trainer

    full = make("a")
    history = full.train()
    assert [s for s, _ in history] == [1, 2, 3, 4, 5, 6]
    assert np.isnan(history[4][1]) and all(np.isfinite(v) for i, (_, v) in enumerate(history) if i != 4)
    if amp:  # grown after steps 2 and 4, halved at 5, grown after 6... (interval 2)
        assert full.scaler.skipped == 1 and full.scaler.scale == 2048.0
    ckpt = os.path.join(str(tmp_path / "a"), "checkpoints", "step_00000003")
    resumed = make("b", checkpoint=ckpt)
    rest = resumed.train()
    np.testing.assert_array_equal([v for _, v in rest], [v for _, v in history[3:]])
    assert_same_bits(backbone_bits(resumed), backbone_bits(full))
    assert_same_bits(head_bits(resumed)[0], head_bits(full)[0])
    assert resumed.scaler.state_dict() == full.scaler.state_dict()
    # The skip acts: without it the same run ends elsewhere.
    clean = trainer_with(tmp_path, data_root, "c", Poisoned(), Global={"checkpoint": ckpt},
                         Loss={"sample_ratio": 0.5})
    clean.train()
    assert not np.array_equal(bits(clean.head.weight), bits(full.head.weight))


def test_float16_scaler_skips_count_only_at_its_floor(tmp_path, data_root):
    """Loss scaling on (as float16 AMP on a GPU; the trainer refuses AMP on the CPU, so the
    scaler is enabled after construction) and every gradient infinite: the scale halves 4 -> 2
    -> 1 without counting, then the skips at the floor count; the third of them (limit 2) stops
    the run at step 5, with no checkpoint of it."""
    backbone = Poisoned()
    trainer = trainer_with(tmp_path, data_root, "amp", backbone,
                           Global={"max_steps": 8, "max_nonfinite_steps": 2},
                           Checkpoint={"interval": 1})
    trainer.scaler = LossScaler(True, init_scale=4.0, min_scale=1.0)
    backbone.grad_poison = True
    with pytest.raises(Diverged, match=r"not finite in 3 consecutive steps \(the last at step 5"):
        trainer.train()
    assert trainer.step == 5 and trainer.scaler.scale == 1.0 and trainer.scaler.skipped == 5
    # The skipped steps saved checkpoints of the unchanged (finite) weights.
    saved = sorted(os.listdir(os.path.join(str(tmp_path / "amp"), "checkpoints")))
    assert "step_00000004" in saved and "step_00000005" not in saved
    checked_closing_block(str(tmp_path / "amp"), 5, "diverged", checkpoint_step=4)


def test_an_overflowing_update_is_not_saved(tmp_path, data_root):
    """A finite gradient times a huge rate gives infinite weights: the save refuses them
    (Diverged) and nothing of that step is on disk."""
    trainer = trainer_with(tmp_path, data_root, "over", Poisoned(), Checkpoint={"interval": 1})
    trainer.train_step(batches(1)[0:1])
    trainer.save()
    with paddle.no_grad():
        trainer.head.weight[0, 0] = float("inf")
    trainer.step += 1
    with pytest.raises(Diverged, match=r"after step 2 are not finite .*checkpoint not written.*"
                                       r"step_00000001"):
        trainer.save()
    names = os.listdir(os.path.join(str(tmp_path / "over"), "checkpoints"))
    assert not any(n.startswith("step_00000002") for n in names), names


def _folder_config(tmp_path, data_root):
    """trainer_common's config as a YAML file for tools/train.py: 8 steps of 8 images,
    a checkpoint every 2, resumed by itself (Global.checkpoint: auto)."""
    cfg = config(data_root, str(tmp_path / "out"), Global={"max_steps": 8, "checkpoint": "auto"},
                 Data={"batch_size": 8}, Checkpoint={"interval": 2})
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    return str(path)


def _run(args, limit=180):
    proc = subprocess.run([sys.executable, TRAIN] + args, capture_output=True, text=True,
                          timeout=limit)
    return proc.returncode, proc.stdout + proc.stderr


def test_a_diverging_run_stops_with_70_and_resumes_from_the_last_finite_checkpoint(tmp_path, data_root):
    """tools/train.py: 4 good steps, then the same run with Optimizer.lr=1e30 resumes and
    diverges: status 70, one line naming the last finite checkpoint, every saved array finite;
    resuming from that checkpoint with the old rate trains to the end."""
    cfg = _folder_config(tmp_path, data_root)
    code, out = _run(["-c", cfg, "-o", "Global.max_steps=4"])
    assert code == 0, out[-3000:]
    code, out = _run(["-c", cfg, "-o", "Optimizer.lr=1e30"])
    assert code == DIVERGED_EXIT_CODE, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("plsc: training diverged")]
    assert len(lines) == 1, out[-3000:]
    assert "Traceback" not in out
    ckpts = os.path.join(str(tmp_path / "out"), "checkpoints")
    finite_ckpt = os.path.join(ckpts, lines[0].split("the last finite checkpoint is ")[1].split(":")[0])
    assert os.path.isdir(finite_ckpt), lines[0]
    assert checked_closing_block(str(tmp_path / "out"), None, "diverged") == finite_ckpt
    for folder in glob.glob(os.path.join(ckpts, "step_*")):
        for npy in glob.glob(os.path.join(folder, "head_rank*", "*.npy")):
            assert np.isfinite(np.load(npy).astype("float64")).all(), npy
        state = paddle.load(os.path.join(folder, "backbone.pdparams"))
        for key, value in state.items():
            assert np.isfinite(np.asarray(value, dtype="float64")).all(), (folder, key)
    code, out = _run(["-c", cfg, "-o", f"Global.checkpoint={finite_ckpt}"])
    assert code == 0, out[-3000:]
    assert "resumed from" in out and "step 8" in out
