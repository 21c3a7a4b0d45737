"""The trainer in one process: resume, checkpoint safety, skipped steps, config errors."""
import os
import signal
import subprocess
import sys

import numpy as np
import paddle
import pytest

from trainer_common import GRAD_CLIP, checked_closing_block, config, make_data
from plsc.config import ConfigError
from plsc.kernels.cpu_kernels import KERNELS_ENV
from plsc.train import Trainer
from plsc.checkpoint import find_checkpoint, read_meta
from plsc.train.amp import LossScaler

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("synthetic")))


@pytest.mark.parametrize("kernels", ["auto", "device"])
@pytest.mark.parametrize("ratio,opt", [(0.5, "sgd"), (1.0, "adamw")])
def test_resume_equals_uninterrupted(tmp_path, data_root, ratio, opt, kernels, monkeypatch):
    """On both kernel sets (PLSC_KERNELS=device: Paddle ops only, what a GPU runs)."""
    monkeypatch.setenv(KERNELS_ENV, kernels)
    sections = dict(Loss={"sample_ratio": ratio}, Optimizer={"name": opt})
    full = Trainer(config(data_root, str(tmp_path / "a"), **sections))
    history = full.train()
    assert [s for s, _ in history] == [1, 2, 3, 4, 5, 6]
    ckpt = os.path.join(str(tmp_path / "a"), "checkpoints", "step_00000003")
    resumed = Trainer(config(data_root, str(tmp_path / "b"), Global={"checkpoint": ckpt}, **sections))
    assert resumed.step == 3
    rest = resumed.train()
    assert [s for s, _ in rest] == [4, 5, 6]
    np.testing.assert_array_equal([v for _, v in rest], [v for _, v in history[3:]])
    for a, b in zip(full.backbone.parameters(), resumed.backbone.parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(full.head.weight.numpy(), resumed.head.weight.numpy())


def test_vit_resume_equals_uninterrupted(tmp_path, data_root):
    """A ViT whose masks and drop path draw from Paddle's generator (and whose blocks are
    recomputed, drawing again in the re-run): the checkpoint's generator state makes the resumed
    steps draw what the uninterrupted run drew."""
    model = {"name": "ViTDemo", "patch_size": 4, "mask_ratio": 0.25, "drop_path_rate": 0.5,
             "recompute": True}
    sections = dict(Model=model, Optimizer={"name": "adamw", "lr": 0.001})
    full = Trainer(config(data_root, str(tmp_path / "a"), **sections))
    history = full.train()
    ckpt = os.path.join(str(tmp_path / "a"), "checkpoints", "step_00000003")
    resumed = Trainer(config(data_root, str(tmp_path / "b"), Global={"checkpoint": ckpt}, **sections))
    rest = resumed.train()
    assert [s for s, _ in rest] == [4, 5, 6]
    np.testing.assert_array_equal([v for _, v in rest], [v for _, v in history[3:]])
    for a, b in zip(full.backbone.parameters(), resumed.backbone.parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # The draws act on the losses compared: other draws give other losses.
    redrawn = Trainer(config(data_root, str(tmp_path / "c"), Global={"checkpoint": ckpt}, **sections))
    paddle.seed(12345)  # after the resume restored the checkpoint's generator: other draws
    other = redrawn.train()
    assert [v for _, v in other] != [v for _, v in history[3:]]


def test_checkpoints_keep_last_and_latest(tmp_path, data_root):
    out = str(tmp_path / "run")
    Trainer(config(data_root, out, Global={"max_steps": 7}, Checkpoint={"interval": 2, "keep_last": 2})).train()
    kept = sorted(d for d in os.listdir(os.path.join(out, "checkpoints")) if d.startswith("step_"))
    assert kept == ["step_00000006", "step_00000007"]
    assert find_checkpoint("latest", out).endswith("step_00000007")
    meta = read_meta(find_checkpoint("latest", out))
    assert meta["step"] == 7 and meta["world_size"] == 1 and meta["num_classes"] == 24
    checked_closing_block(out, 7, "finished", checkpoint_step=7)


def test_train_log_says_where_the_model_is(tmp_path):
    """train.log of a run that generates its data: the generation's two lines, a line for
    each checkpoint (Checkpoint.interval 4 of 6 steps: steps 4 and 6) naming its folder, and
    the closing block (the best of the evaluations every 2 steps, the final checkpoint)."""
    import re
    data, out = str(tmp_path / "data"), str(tmp_path / "run")
    Trainer(config(data, out, Eval={"root": data, "targets": ["val"], "interval": 2,
                                    "batch_size": 20},
                   Checkpoint={"interval": 4})).train()
    log = open(os.path.join(out, "train.log")).read()
    assert re.search(rf"plsc: generating the synthetic data set under {data} .*\n.* plsc: 144 "
                     r"training images of 24 identities and 40 verification pairs written in "
                     r"\d+\.\d s\n", log), log[:2000]
    written = re.findall(r"checkpoint of step (\d+) written: (\S+) \((\d+\.\d\d) s\)\n", log)
    assert [int(step) for step, _, _ in written] == [4, 6], log
    for step, path, _ in written:
        assert read_meta(path)["step"] == int(step) and path == os.path.join(
            out, "checkpoints", f"step_{int(step):08d}")
    assert len(re.findall(r"\[val\] step \d+ accuracy", log)) == 3
    assert checked_closing_block(out, 6, "finished", checkpoint_step=6) == written[-1][1]


def test_kill_during_save_leaves_previous_checkpoint(tmp_path, data_root):
    out = str(tmp_path / "killed")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "trainer_kill_worker.py"), data_root, out],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    root = os.path.join(out, "checkpoints")
    assert os.path.isdir(os.path.join(root, "step_00000006.tmp"))  # the save that was cut short
    latest = find_checkpoint("latest", out)
    assert latest.endswith("step_00000003")
    resumed = Trainer(config(data_root, out, Global={"checkpoint": "latest"}))
    assert resumed.step == 3
    assert [s for s, _ in resumed.train()] == [4, 5, 6]
    assert find_checkpoint("latest", out).endswith("step_00000006")


def test_non_finite_step_is_skipped_and_counted(tmp_path, data_root):
    """A loss scale so large that the gradients overflow: no update, scale halved, counted."""
    trainer = Trainer(config(data_root, str(tmp_path / "amp")))
    trainer.scaler = LossScaler(True, init_scale=3e38)
    trainable = [p for p in trainer.backbone.parameters() if not p.stop_gradient]
    before = [p.numpy().copy() for p in trainable]
    head_before = trainer.head.weight.numpy().copy()
    images = paddle.to_tensor(np.random.RandomState(0).normal(size=(4, 3, 16, 16)).astype("float32"))
    trainer.train_step([(images, paddle.to_tensor([0, 1, 2, 3]))])
    assert trainer.scaler.skipped == 1 and trainer.scaler.scale == 1.5e38 and trainer.step == 1
    for p, b in zip(trainable, before):
        np.testing.assert_array_equal(p.numpy(), b)
    np.testing.assert_array_equal(trainer.head.weight.numpy(), head_before)
    # A sane scale then trains normally.
    trainer.scaler = LossScaler(True, init_scale=1024.0)
    trainer.train_step([(images, paddle.to_tensor([0, 1, 2, 3]))])
    assert trainer.scaler.skipped == 0
    assert not np.array_equal(trainer.head.weight.numpy(), head_before)


def test_missing_dataset_points_to_the_tools(tmp_path):
    cfg = config(str(tmp_path / "nowhere"), str(tmp_path / "o"), Data={"dataset": "recordio"})
    with pytest.raises(ConfigError, match=r"Data.root .*nowhere does not exist; .*tools/pack_rec.py.*"
                                          r"configs/demo.yaml"):
        Trainer(cfg)


def test_train_cli_reports_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("Loss: {num_classes: 10}\nData: {root: /x, batch_sise: 3}\n")
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "tools", "train.py"),
                           "-c", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown key 'Data.batch_sise'; did you mean 'batch_size'?" in proc.stderr


def test_reshard_tool_export_and_import(tmp_path, data_root):
    out = str(tmp_path / "one")
    Trainer(config(data_root, out, Global={"max_steps": 3}, Loss={"sample_ratio": 0.5})).train()
    src = os.path.join(out, "checkpoints", "step_00000003")
    weight = np.load(os.path.join(src, "head_rank0", "weight.npy"))
    velocity = np.load(os.path.join(src, "head_rank0", "opt.weight.velocity.npy"))
    tool = [sys.executable, os.path.join(os.path.dirname(HERE), "tools", "reshard.py"), src]

    def run(*args):
        proc = subprocess.run(tool + list(args), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc

    three = str(tmp_path / "three")
    run("--world-size", "3", "--output", three)
    assert read_meta(three)["world_size"] == 3
    parts = [np.load(os.path.join(three, f"head_rank{r}", "weight.npy")) for r in range(3)]
    assert [len(p) for p in parts] == [8, 8, 8]
    np.testing.assert_array_equal(np.concatenate(parts), weight)

    run("--export", str(tmp_path / "w.npy"))
    np.testing.assert_array_equal(np.load(tmp_path / "w.npy"), weight)
    run("--export", str(tmp_path / "v.npy"), "--array", "opt.weight.velocity")
    np.testing.assert_array_equal(np.load(tmp_path / "v.npy"), velocity)

    new = np.random.RandomState(0).normal(size=weight.shape).astype("float32")
    np.save(tmp_path / "new.npy", new)
    imported = str(tmp_path / "imported")
    run("--import", str(tmp_path / "new.npy"), "--output", imported)
    resumed = Trainer(config(data_root, str(tmp_path / "r"), Global={"checkpoint": imported}))
    np.testing.assert_array_equal(resumed.head.weight.numpy(), new)
    assert not resumed.head_opt.state_dict()["weight.velocity"].numpy().any()

    # One process resuming the 3-rank checkpoint gets the original classifier back.
    back = Trainer(config(data_root, str(tmp_path / "b"), Global={"checkpoint": three}))
    np.testing.assert_array_equal(back.head.weight.numpy(), weight)

    bad = subprocess.run(tool + ["--world-size", "30", "--output", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "cannot split 24 classes over 30 ranks" in bad.stderr


def test_gradient_accumulation_equals_the_whole_batch(tmp_path, data_root):
    """Two micro-batches of 4 give the step of one batch of 8 (backbone without batch statistics)."""
    from trainer_common import make_backbone
    rng = np.random.RandomState(3)
    images = rng.normal(size=(8, 3, 16, 16)).astype("float32")
    labels = rng.randint(0, 24, 8).astype("int64")
    results = []
    for micro in (1, 2):
        trainer = Trainer(config(data_root, str(tmp_path / f"acc{micro}"),
                                 Optimizer={"accumulate_steps": micro}), backbone=make_backbone(0))
        trainer.head.weight.set_value(np.random.RandomState(4).normal(0, 0.1, (24, 32)).astype("float32"))
        parts = np.array_split(np.arange(8), micro)
        trainer.train_step([(paddle.to_tensor(images[p]), paddle.to_tensor(labels[p])) for p in parts])
        results.append([p.numpy() for p in trainer.backbone.parameters()] + [trainer.head.weight.numpy()])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_lr_schedules_follow_their_formulas():
    from plsc.optim.schedule import StepLR, make_lr_fn
    poly = make_lr_fn("poly", 0.1, total_steps=100, warmup_steps=10, power=2.0)
    assert poly(0) == pytest.approx(0.01) and poly(9) == pytest.approx(0.1)
    assert poly(55) == pytest.approx(0.1 * (1 - 45 / 90) ** 2)
    piece = make_lr_fn("piecewise", 0.1, total_steps=100, boundaries=[30, 60], gamma=0.1)
    assert [piece(s) for s in (29, 30, 60)] == pytest.approx([0.1, 0.01, 0.001])
    cos = make_lr_fn("cosine", 0.1, total_steps=100)
    assert cos(50) == pytest.approx(0.05) and cos(100) == pytest.approx(0.0)
    sched = StepLR(poly)
    seen = []
    for _ in range(3):
        seen.append(sched())
        sched.step()
    assert seen == pytest.approx([poly(0), poly(1), poly(2)])


def test_chunked_head_trains_like_the_dense_one(tmp_path, data_root):
    """Loss.chunk_size changes memory, not results: the same losses to fp32 rounding."""
    dense = Trainer(config(data_root, str(tmp_path / "dense"), Global={"max_steps": 3})).train()
    chunked = Trainer(config(data_root, str(tmp_path / "chunked"), Global={"max_steps": 3},
                             Loss={"chunk_size": 5})).train()
    np.testing.assert_allclose([v for _, v in chunked], [v for _, v in dense], rtol=1e-4)


def test_loss_scale_growth_does_not_change_the_step(tmp_path, data_root):
    """With scaling on (growing after every good step) the update equals the unscaled one."""
    from trainer_common import make_backbone
    rng = np.random.RandomState(5)
    images = paddle.to_tensor(rng.normal(size=(4, 3, 16, 16)).astype("float32"))
    labels = paddle.to_tensor(rng.randint(0, 24, 4).astype("int64"))
    results, norms = [], []
    for scaler in (None, LossScaler(True, init_scale=1024.0, growth_interval=1)):
        trainer = Trainer(config(data_root, str(tmp_path / str(bool(scaler)))), backbone=make_backbone(0))
        trainer.head.weight.set_value(np.random.RandomState(6).normal(0, 0.1, (24, 32)).astype("float32"))
        if scaler is not None:
            trainer.scaler = scaler
        for _ in range(2):
            if scaler is None:  # train_step of one micro-batch, with a look at the gradient norm
                trainer.forward_backward(images, labels)
                norms.append(np.sqrt(sum(float((p.grad.numpy().astype("float64") ** 2).sum())
                                         for p in trainer.backbone.parameters() if p.grad is not None)))
                trainer.optimizer_step()
            else:
                trainer.train_step([(images, labels)])
        results.append([p.numpy() for p in trainer.backbone.parameters()] + [trainer.head.weight.numpy()])
    # The clip must not act, or it rescales every step to the same norm and hides a scale error
    # (gradients left 1024-4096 times too large would then pass).
    assert 0 < max(norms) < GRAD_CLIP / 2, norms
    assert trainer.scaler.scale == 4096.0
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_trainer_schedule_takes_the_warmup_indexing(tmp_path, data_root):
    """LRScheduler.warmup_indexing reaches the trainer's rate: arcface_torch's train_v2.py runs
    step 0 at the full rate and step i in 1..W at i/W, then decays linearly (power 1) over the
    T - W steps after the warmup (PolynomialLRWarmup, lr_scheduler.py); plsc's default gives
    (i+1)/W."""
    rates = {}
    for indexing in ("arcface_torch", "plsc"):
        trainer = Trainer(config(data_root, str(tmp_path / indexing), Global={"max_steps": 8},
                                 Optimizer={"lr": 0.2},
                                 LRScheduler={"name": "poly", "warmup_steps": 4, "power": 1.0,
                                              "warmup_indexing": indexing}))
        rates[indexing] = [trainer.lr.lr_fn(i) for i in range(8)]
    w, t = 4, 8
    torch_like = [0.2] + [0.2 * i / w for i in range(1, w + 1)] + \
        [0.2 * (1 - (i - w) / (t - w)) for i in range(w + 1, t)]
    assert rates["arcface_torch"] == pytest.approx(torch_like, rel=1e-12)
    assert rates["plsc"][:w] == pytest.approx([0.2 * (i + 1) / w for i in range(w)], rel=1e-12)


def test_malloc_pages_released_after_the_first_steps_and_saves(tmp_path, data_root, monkeypatch):
    """cpu_setup.release_freed_memory runs after the first SETTLING_STEPS steps and after each
    checkpoint or evaluation, not after every step, nor after the last."""
    from plsc.process import cpu_setup
    trainer = Trainer(config(data_root, str(tmp_path / "run"), Global={"max_steps": 8},
                             Checkpoint={"interval": 5}))
    calls = []
    monkeypatch.setattr(cpu_setup, "release_freed_memory", lambda: calls.append(trainer.step))
    trainer.train()
    assert calls == list(range(1, cpu_setup.SETTLING_STEPS + 1)) + [5]
