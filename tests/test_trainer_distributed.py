"""The trainer on real gloo ranks: k ranks equal one process; resume on another world size."""
import json
import os

import numpy as np
import pytest

from trainer_common import make_data
from oracles import rel_err

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def group(tmp_path_factory, run_ranks):
    """`group(key, nprocs, mode, *args)`: trainer_ranks.py run once per `key` (extra `args`
    passed on); (its out dir, rank 0's report)."""
    runs = {}

    def run(key, nprocs, mode, *args):
        if key not in runs:
            data = make_data(str(tmp_path_factory.getbasetemp() / "trainer_data"))
            out = str(tmp_path_factory.mktemp(key))
            done = run_ranks(os.path.join(HERE, "trainer_ranks.py"), nprocs,
                             ["--mode", mode, "--data", data, "--out", out, *args], cwd=out,
                             timeout=600)
            assert done.status == 0 and done.reports[0], f"{key} failed:\n{done.tail()}"
            runs[key] = (out, done.reports[0])
        return runs[key]
    return run


def bf16_bits_rne(x):
    """numpy float32 -> bfloat16 bits (uint16), rounded to nearest even (finite x)."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_float32(bits):
    """bfloat16 bits (uint16) -> float32 values (exact)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def checkpoint_rows(ckpt, name, world_size):
    """Head array `name` of every class as the checkpoint stores it (its per-rank .npy files)."""
    return np.concatenate([np.load(os.path.join(ckpt, f"head_rank{r}", f"{name}.npy"))
                           for r in range(world_size)])


def two_rank_checkpoints(group):
    """(float32 run, its step-2 checkpoint, bfloat16 run, its step-2 checkpoint) on 2 ranks."""
    out32, two32 = group("ranks2", 2, "invariant")
    out16, two16 = group("ranks2_bf16", 2, "invariant", "--dtype", "bfloat16")
    step2 = os.path.join("run", "checkpoints", "step_00000002")
    return two32, os.path.join(out32, step2), two16, os.path.join(out16, step2)


def resume_on_three(group):
    """One 3-rank group resuming, in turn: the float32 checkpoint as float32 and as bfloat16,
    the bfloat16 checkpoint as bfloat16 and as float32."""
    _, ck32, _, ck16 = two_rank_checkpoints(group)
    return group("resume3", 3, "resume",
                     "--resume", f"f32=float32:{ck32}", "--resume", f"f32_to_bf16=bfloat16:{ck32}",
                     "--resume", f"bf16=bfloat16:{ck16}", "--resume", f"bf16_to_f32=float32:{ck16}")[1]


@pytest.mark.parametrize("world_size", [2, 3])
def test_k_ranks_equal_one_process(world_size, group):
    """Two SGD steps (momentum, weight decay, clipping) on k ranks vs one process, same global batches."""
    _, single = group("single", 1, "invariant")
    _, multi = group(f"ranks{world_size}", world_size, "invariant")
    assert set(single) == set(multi)
    for key in set(single) - {"overlap_equal"}:  # (the next test's)
        assert rel_err(multi[key], single[key]) < 1e-5, (key, rel_err(multi[key], single[key]))
    from trainer_ranks import full_classifier
    assert rel_err(single["head"], full_classifier()) > 1e-3  # the steps did move the classifier


def test_resume_on_three_ranks_reshards_the_head(group):
    """A checkpoint written by 2 ranks, resumed on 3: every class row and its momentum land on
    the rank that now owns them, the backbone is restored, and training goes on."""
    two, _, two16, _ = two_rank_checkpoints(group)
    three = resume_on_three(group)
    for tag, before in (("f32", two), ("bf16", two16)):  # the same dtype: the same bits
        assert int(three[f"{tag}.step"]) == 2 and int(three[f"{tag}.num_local"]) == 8
        assert three[f"{tag}.head"].dtype == before["head"].dtype
        np.testing.assert_array_equal(three[f"{tag}.head"], before["head"])
        np.testing.assert_array_equal(three[f"{tag}.velocity"], before["velocity"])
        for key in before:
            if key.startswith("backbone."):
                np.testing.assert_array_equal(three[f"{tag}.{key}"], before[key])
        assert np.isfinite(three[f"{tag}.losses"]).all()
    assert int(three["bf16.step_count"]) == 2  # the rounding's step count goes on


def test_bfloat16_checkpoint_resumes_on_three_ranks_in_float32(group):
    """A 2-rank bfloat16 run's checkpoint resumed on 3 ranks with float32 centres: every class
    row and its momentum are the exact upcast of the checkpoint's bfloat16 bits."""
    _, _, two16, ck16 = two_rank_checkpoints(group)
    three = resume_on_three(group)
    meta = json.load(open(os.path.join(ck16, "meta.json")))
    assert meta["head_dtypes"]["weight"] == meta["head_dtypes"]["opt.weight.velocity"] == "bfloat16"
    assert meta["head_opt_step_count"] == 2
    for name, key in (("weight", "head"), ("opt.weight.velocity", "velocity")):
        stored = checkpoint_rows(ck16, name, 2)
        assert stored.dtype == np.uint16 and stored.shape[0] == 24
        np.testing.assert_array_equal(stored, two16[key])  # the run's state, as it was
        got = three[f"bf16_to_f32.{key}"]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32),
                                      bf16_bits_to_float32(stored).view(np.uint32))
    assert str(three["bf16_to_f32.dtype"]) == "float32"
    assert int(three["bf16_to_f32.step"]) == 2 and int(three["bf16_to_f32.step_count"]) == 2
    assert np.isfinite(three["bf16_to_f32.losses"]).all()
    assert np.isfinite(three["bf16_to_f32.after"]).all()
    assert not np.array_equal(three["bf16_to_f32.after"], three["bf16_to_f32.head"])


def test_float32_checkpoint_resumes_on_three_ranks_in_bfloat16(group):
    """A 2-rank float32 checkpoint resumed on 3 ranks with bfloat16 centres: every row and its
    momentum are the float32 values rounded to nearest even (numpy oracle); training goes on."""
    _, ck32, _, _ = two_rank_checkpoints(group)
    three = resume_on_three(group)
    for name, key in (("weight", "head"), ("opt.weight.velocity", "velocity")):
        stored = checkpoint_rows(ck32, name, 2)
        assert stored.dtype == np.float32 and stored.shape[0] == 24
        expect = bf16_bits_rne(stored)
        truncated = (stored.view(np.uint32) >> 16).astype(np.uint16)
        assert (expect != truncated).any()  # the oracle tells nearest from truncation here
        got = three[f"f32_to_bf16.{key}"]
        assert got.dtype == np.uint16  # bfloat16 bits
        np.testing.assert_array_equal(got, expect)
    assert str(three["f32_to_bf16.dtype"]) == "bfloat16" and int(three["f32_to_bf16.step"]) == 2
    losses = three["f32_to_bf16.losses"]
    assert len(losses) == 2 and np.isfinite(losses).all()
    after = bf16_bits_to_float32(three["f32_to_bf16.after"])
    assert np.isfinite(after).all()
    assert not np.array_equal(three["f32_to_bf16.after"], three["f32_to_bf16.head"])  # it trained


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_launch_on_loopback(tmp_path_factory, run_ranks):
    """Two `paddle.distributed.launch --nnodes 2` processes, one rank each, train and agree."""
    data = make_data(str(tmp_path_factory.getbasetemp() / "trainer_data"))
    out = str(tmp_path_factory.mktemp("two_nodes"))
    port = _free_port()
    groups = [run_ranks(os.path.join(HERE, "two_node_worker.py"), 1, [data, out], cwd=out,
                        launch_args=["--nnodes", "2", "--master", f"127.0.0.1:{port}",
                                     "--rank", str(node)], wait=False) for node in (0, 1)]
    nodes = [group.wait() for group in groups]
    for node in nodes:
        assert node.status == 0, node.tail()
    ranks = [nodes[0].reports[0], nodes[1].reports[1]]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert len(ranks[0]["losses"]) == 4 and ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["backbone"] == ranks[1]["backbone"]


def test_demo_config_end_to_end_shortened(tmp_path_factory, run_ranks):
    """configs/demo.yaml on 2 launched ranks, shortened: trains, evaluates, logs, checkpoints."""
    out = str(tmp_path_factory.mktemp("demo"))
    data = os.path.join(out, "data")
    root = os.path.dirname(HERE)
    done = run_ranks(
        os.path.join(root, "tools", "train.py"), 2,
        ["-c", os.path.join(root, "configs", "demo.yaml"),
         "-o", f"Global.output_dir={out}/run", "-o", "Global.max_steps=12",
         "-o", f"Data.root={data}", "-o", f"Eval.root={data}", "-o", "Eval.interval=6",
         "-o", "Loss.num_classes=60", "-o", "Data.image_size=[32, 32]", "-o", "Data.batch_size=16",
         "-o", "Data.synthetic={num_identities: 60, images_per_identity: 8, "
               "num_val_identities: 20, num_pairs: 100}",
         "-o", "Checkpoint.interval=6"], cwd=out, timeout=600)
    log = open(os.path.join(out, "run", "train.log")).read() if os.path.exists(
        os.path.join(out, "run", "train.log")) else ""
    assert done.status == 0, done.tail()
    for rank in (0, 1):  # Paddle's ccache warning is left out (plsc.process.runtime)
        assert "ccache" not in done.logs[rank], done.logs[rank][:2000]
    assert "plsc: generating the synthetic data set under" in done.logs[0], done.logs[0][:3000]
    assert "480 training images of 60 identities and 100 verification pairs written" in done.logs[0]
    for step in (0, 6, 12):
        assert f"[val] step {step} accuracy" in log, log
    assert "step 12/12" in log
    ckpt = os.path.join(out, "run", "checkpoints", "step_00000012")
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("head_rank")) == ["head_rank0", "head_rank1"]
    assert os.listdir(os.path.join(out, "run", "vdl"))
    # One set of BatchNorm statistics: the evaluation logged during training (each rank embeds
    # its share of the pack with its backbone) is what the saved weights give, here evaluated
    # on one rank by the function tools/eval.py runs.
    from plsc.config import load_config
    from plsc.apps.tasks import evaluate
    best = json.load(open(os.path.join(out, "run", "best_val", "best.json")))
    cfg = load_config(os.path.join(out, "run", "config.yaml"),
                      ["Global.checkpoint=null",
                       f"Global.pretrained={os.path.join(out, 'run', 'best_val', 'backbone.pdparams')}",
                       f"Global.output_dir={os.path.join(out, 'eval')}"])
    again = evaluate(cfg, out=open(os.devnull, "w"))["val"]
    assert abs(again["accuracy"] - best["accuracy"]) <= 1e-6, (again["accuracy"], best)
    assert abs(again["embedding_norm"] - best["embedding_norm"]) <= 1e-6 * best["embedding_norm"], \
        (again["embedding_norm"], best)


def test_a_non_finite_head_gradient_on_one_rank_skips_the_step_on_every_rank(group):
    """The head's finiteness rides along in the backbone's gradient all-reduce: with a NaN
    head gradient on rank 1 only, both ranks keep their backbone's bits and count the skip."""
    _, multi = group("ranks2", 2, "invariant")
    np.testing.assert_array_equal(multi["skip_agreed"], [1.0, 1.0])


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradients_summed_during_the_backward_equal_the_sum_after_it(world_size, group):
    """`OverlappedSum` (all-reduces started by the parameters' hooks during the backward)
    against `sum_gradients` after it, on the same local gradients: equal bit for bit on
    every rank on two ranks, and the head's flag riding along is summed too. On three, gloo's
    ring adds an element's three terms in an order that depends on its place in the flat
    buffer, which the buckets change: equal within float32 rounding."""
    _, multi = group(f"ranks{world_size}", world_size, "invariant")
    equal, extra, worst = multi["overlap_equal"]
    assert extra == 1.0
    if world_size == 2:
        assert equal == 1.0 and worst == 0.0
    else:
        assert worst < 1e-6, worst
