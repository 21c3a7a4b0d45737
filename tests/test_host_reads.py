"""A training step reads the device once and makes no op whose output shape depends on the
data (on a GPU either waits for the queue to drain), on both kernel sets.

Counted (tests/host_reads.py) between the end of step 1 and the end of step 2 of a run: the
batch fetch, the stop agreement, the forward, backward and update, the log line. Not counted:
tensors that live on the host on any device (Partial FC's step counter; the stop agreement's
flag, a CPU tensor all-reduced over a gloo group, `preemption.host_group`).
"""

import paddle
import pytest

from trainer_common import config, make_data
from host_reads import HostReads
from plsc.kernels.cpu_kernels import KERNELS_ENV
from plsc.train import Trainer
from plsc.train.amp import LossScaler

HOST_FLAG = ("plsc/train/preemption.py", " agree")

CASES = {
    "dense-sgd": dict(Loss={"sample_ratio": 1.0}),
    "pfc-adamw-bf16-fp16scaler": dict(Loss={"sample_ratio": 0.5, "param_dtype": "bfloat16"},
                                      Optimizer={"name": "adamw"}),
    "pfc-accumulate": dict(Loss={"sample_ratio": 0.5}, Optimizer={"accumulate_steps": 2}),
    "pfc-adamw-int8-int4": dict(Loss={"sample_ratio": 0.5, "param_dtype": "int8"},
                                Optimizer={"name": "adamw", "head_state_dtype": "int4"}),
    # int(0.1 · 24) = 2 centres, fewer than the global batch of 4: the positives are counted
    "pfc-below-batch": dict(Loss={"sample_ratio": 0.1}),
}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("synthetic")))


@pytest.fixture(params=["auto", "device"])
def kernels(request, monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, request.param)
    return request.param


def step_two(data_root, out, kernels, case):
    """(reads, data-dependent-shape ops) of step 2 of a 3-step run of `case`."""
    sections = CASES[case]
    optimizer = dict(sections.get("Optimizer", {}))
    cfg = config(data_root, out, Global={"max_steps": 3}, Checkpoint={"interval": 100},
                 **dict(sections, Optimizer=dict({"lr": 0.05, "momentum": 0.9,
                                                  "weight_decay": 5e-4}, **optimizer)))
    trainer = Trainer(cfg)
    if "fp16scaler" in case:  # AMP float16's loss scaler (its device check rides in the read)
        trainer.scaler = LossScaler(True, init_scale=1024.0)
    counter = HostReads(host=[trainer.head.sample_step],
                        skip=lambda caller: HOST_FLAG[0] in caller and HOST_FLAG[1] in caller)
    counter.active = False
    real = trainer._after_step

    def after_step():
        real()
        counter.active = trainer.step == 1
    trainer._after_step = after_step
    with counter:
        history = trainer.train()
    assert [s for s, _ in history] == [1, 2, 3]
    return counter.reads, counter.shape_ops


def test_the_counter_sees_every_read():
    x, v = paddle.to_tensor(2.5), paddle.to_tensor([2.5, 0.0])
    with HostReads() as counted:
        float(x), int(x), bool(x > 0), x.item(), v.tolist(), v.numpy()
        paddle.unique(v), paddle.masked_select(v, v > 0), paddle.nonzero(v), v.unique()
    assert [name for name, _ in counted.reads] == ["__float__", "__int__", "__bool__", "item",
                                                   "tolist", "numpy"]
    assert [name for name, _ in counted.shape_ops] == ["unique", "masked_select", "nonzero",
                                                       "unique"]
    with HostReads(host=[x]) as counted:
        float(x)
    assert counted.reads == []


@pytest.mark.parametrize("case", [c for c in CASES if c != "pfc-below-batch"])
def test_a_step_reads_the_device_once(tmp_path, data_root, kernels, case):
    """The losses of every micro-batch, their label checks, the finite flag of both parts'
    gradients and the float16 scaler's found-inf come back in one read
    (`PartialFC.read_loss_checks`); nothing else in the trainer, backbone or data path reads
    (the head's and the optimizer's device sets read nothing)."""
    reads, shape_ops = step_two(data_root, str(tmp_path / "out"), kernels, case)
    assert len(reads) == 1 and " read_loss_checks < plsc/train/trainer.py" in reads[0][1], reads
    if case != "pfc-accumulate":  # (its paddle.unique: the last test)
        assert shape_ops == []


def test_accumulated_step_has_no_data_dependent_shape(tmp_path, data_root, kernels):
    """The micro-batches' sampled rows are merged by a stable sort on the device set; the CPU
    set merges CPU tensors with `paddle.unique` (no device to wait for)."""
    reads, shape_ops = step_two(data_root, str(tmp_path / "out"), kernels, "pfc-accumulate")
    assert len(reads) <= 1, reads
    if kernels == "device":
        assert shape_ops == [], shape_ops
    else:
        assert [op for op, _ in shape_ops] == ["unique"], shape_ops


def test_a_partial_fc_step_below_the_batch_reads_the_positives_once_more(tmp_path, data_root,
                                                                         kernels):
    """When ratio · classes of the shard is below the global batch, the positives can outnumber
    the samples and the sample count becomes theirs (PLSC's and arcface_torch's rule): an output
    shape, so sampling reads it (docs/head.md). That one read more, and nothing else."""
    reads, shape_ops = step_two(data_root, str(tmp_path / "out"), kernels, "pfc-below-batch")
    assert shape_ops == [] and len(reads) == 2, (reads, shape_ops)
    assert reads[0][1].startswith("plsc/nn/sampling.py") and reads[0][0] == "__int__", reads
