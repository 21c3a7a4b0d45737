"""The backbone's gradient sum: `OverlappedSum`'s buckets; the sums on 2 real ranks with
float32, float16 and bfloat16 on the wire against numpy, on both kernel sets, in each
Optimizer.grad_sync mode and by `sum_gradients` (tests/grad_sync_ranks.py), with the order of
the backward's end and the first all-reduce's start; the trainer with
Optimizer.grad_allreduce_dtype=float16 in each mode, its step timers' hidden and exposed parts.
(`OverlappedSum` against `sum_gradients` inside the trainer: test_trainer_distributed.py.)"""
import os

import numpy as np
import paddle
import pytest

from grad_sync_ranks import GATE_SECONDS, MODES, PATHS, SHAPES, WIRES, extra_values, local_gradients
from trainer_common import make_backbone, make_data
from plsc.train.grad_sync import OverlappedSum, sum_gradients

HERE = os.path.dirname(os.path.abspath(__file__))


def test_buckets_follow_the_backward_and_the_byte_budget():
    """Reverse parameter order (the order the backward completes gradients), each bucket at
    most the budget unless one parameter alone exceeds it; frozen parameters left out."""
    sizes = (10, 300, 50, 50, 400, 5, 2000)
    params = [paddle.create_parameter([n], "float32") for n in sizes]
    params[1].stop_gradient = True
    summed = OverlappedSum(params, bucket_bytes=400 * 4)
    layout = [[p.shape[0] for p in bucket] for bucket in summed.buckets]
    expected, bucket = [], []
    for n in [n for i, n in reversed(list(enumerate(sizes))) if i != 1]:
        if bucket and 4 * (sum(bucket) + n) > 400 * 4:
            expected.append(bucket)
            bucket = []
        bucket.append(n)
    expected.append(bucket)
    assert layout == expected == [[2000], [5], [400], [50, 50, 10]]
    summed.arm()
    extra = paddle.ones([1])
    assert summed.finish(extra=extra) is extra  # one process: nothing to sum


def test_an_all_reduce_failing_in_the_backward_is_raised_by_finish(monkeypatch):
    """Paddle's backward turns an exception in a hook into a SystemError without its message;
    a lost rank's error (which the trainer reports as RankLost) must reach `finish` intact."""
    from plsc.train import grad_sync
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:576] Read error [127.0.0.1]:30631: "
                        "Connection reset by peer")

    def fail(*args, **kwargs):
        raise lost
    monkeypatch.setattr(grad_sync.pd, "group_rank_size", lambda group=None: (0, 2))
    monkeypatch.setattr(grad_sync, "_reduce_flat", fail)
    layer = paddle.nn.Linear(3, 2)
    summed = OverlappedSum(layer.parameters(), mode="backward")
    summed.arm()
    layer(paddle.rand([4, 3])).sum().backward()  # the hooks' all-reduce fails: kept, not raised
    with pytest.raises(RuntimeError) as info:
        summed.finish()
    assert info.value is lost


def test_a_wire_dtype_outside_the_three_is_refused():
    with pytest.raises(ValueError, match="float16"):
        OverlappedSum(paddle.nn.Linear(2, 2).parameters(), dtype="int8")


def test_auto_is_the_thread_on_the_cpu_and_the_hooks_on_a_gpu():
    """Optimizer.grad_sync auto: a communication thread where gloo runs each all-reduce to its
    end (the CPU), the backward's hooks where NCCL's are asynchronous; an explicit mode is
    kept; OverlappedSum resolves it on this (CPU) machine."""
    from plsc.train.grad_sync import resolve_mode
    assert resolve_mode("auto", "cpu") == "thread"
    assert resolve_mode("auto", "gpu:0") == "backward"
    assert [resolve_mode(m, "cpu") for m in MODES] == list(MODES)
    assert OverlappedSum(paddle.nn.Linear(2, 2).parameters(), mode="auto").mode == "thread"


def test_the_thread_group_has_the_jobs_backend(monkeypatch):
    """`thread` sums on a group of its own: through `gloo_group` (a store of its own) on gloo,
    Paddle's `new_group` of the job's backend on NCCL (a GPU's tensors)."""
    from plsc.train import grad_sync
    made = []
    monkeypatch.setattr(grad_sync.pd, "group_rank_size", lambda group=None: (0, 2))
    monkeypatch.setattr(grad_sync.pd, "gloo_group", lambda ranks=None: made.append(ranks) or "own")
    monkeypatch.setattr(paddle.distributed, "new_group",
                        lambda ranks=None: made.append(ranks) or "nccl")
    for backend, want in (("GLOO", "own"), ("NCCL", "nccl")):
        made.clear()
        monkeypatch.setattr(grad_sync.pd, "get_backend", lambda: backend)
        summed = OverlappedSum(paddle.nn.Linear(2, 2).parameters(), mode="thread")
        assert summed.group == want and made == [None], backend


@pytest.mark.parametrize("how", ["overlapped", "after"])
@pytest.mark.parametrize("wire", ["float16", "bfloat16", "float32"])
def test_one_rank_rounds_the_gradients_as_a_one_rank_all_reduce(how, wire):
    """One process, a 16-bit wire: each gradient comes back as the 1-rank all-reduce of that
    dtype returns it (arcface_torch's fp16 hook on one GPU): numpy's round trip of the float32
    values, bit for bit (float16 beyond 65504: inf); float32: untouched. `extra` untouched."""
    layers = paddle.nn.Sequential(paddle.nn.Linear(40, 30), paddle.nn.Linear(30, 7))
    rng = np.random.default_rng(5)
    grads = [(rng.standard_normal(p.shape) * 10.0 ** rng.integers(-9, 5, p.shape)).astype(np.float32)
             for p in layers.parameters()]
    grads[-1][0] = 70000.0  # beyond float16's range
    for p, g in zip(layers.parameters(), grads):
        p.grad = paddle.to_tensor(g)
    extra = paddle.to_tensor([1.0 / 3.0, 70000.0])
    if how == "overlapped":
        gs = OverlappedSum(layers.parameters(), dtype=wire, bucket_bytes=1000)
        gs.arm()
        out = gs.finish(extra)
    else:
        out = sum_gradients(list(layers.parameters()), extra=extra, dtype=wire)
    for p, g in zip(layers.parameters(), grads):
        np.testing.assert_array_equal(p.grad.numpy().view(np.uint32), round_to(g, wire).view(np.uint32))
    np.testing.assert_array_equal(out.numpy(), np.float32([1.0 / 3.0, 70000.0]))


# ---- 2 ranks

def round_to(x, dtype):
    """numpy float32 -> the nearest `dtype` value (ties to even; float16 beyond 65504: inf),
    as float32."""
    x = np.asarray(x, np.float32)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":  # keep the upper 16 bits, rounded on the lower 16 (finite x)
        b = x.view(np.uint32).astype(np.uint64)
        return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    return x


def expected_sum(i, wire):
    """Gradient `i` summed over the 2 ranks as a `wire` all-reduce returns it: the float32 sum
    of the two ranks' `wire`-rounded gradients, rounded to `wire` (a 16-bit all-reduce
    returns 16-bit values; for two addends rounding the exact sum once equals rounding its
    float32 rounding, since float32's 24 bits are at least 2p + 2 for p = 11 and 8)."""
    summed = round_to(local_gradients(0)[i], wire) + round_to(local_gradients(1)[i], wire)
    return round_to(summed, wire)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, run_ranks):
    """Both ranks' reports of tests/grad_sync_ranks.py."""
    data = make_data(str(tmp_path_factory.getbasetemp() / "trainer_data"))
    out = str(tmp_path_factory.mktemp("grad_sync"))
    done = run_ranks(os.path.join(HERE, "grad_sync_ranks.py"), 2, ["--data", data, "--out", out],
                     cwd=out, timeout=300)
    assert done.status == 0 and all(done.reports), done.tail()
    return done.reports


def test_each_rank_ends_as_a_rank_of_several(two_ranks):
    """`plsc.process.ending` sees the real group of two (each rank then ends through os._exit,
    and the run's status above is 0)."""
    assert [bool(r["rank_of_several"]) for r in two_ranks] == [True, True]


CASES = WIRES + ("float16_device",)  # float16's gathered sum on the device kernel set too


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
def test_sums_equal_the_float32_sum_of_the_rounded_gradients_bit_for_bit(two_ranks, case, path):
    """Each rank's sums against numpy; the 16-bit sums differ from float32's (the rounding is
    there to see), float16's overflow at 65504 included."""
    wire = case.split("_")[0]
    for rank, report in enumerate(two_ranks):
        for i in range(len(SHAPES)):
            got = report[f"{case}.{path}.grad{i}"]
            want = expected_sum(i, wire)
            assert got.dtype == np.float32 and got.shape == want.shape
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
                f"rank {rank} grad{i}: {int((got != want).sum())} elements differ"
    if wire != "float32":
        exact = [expected_sum(i, "float32") for i in range(len(SHAPES))]
        rounded = [expected_sum(i, wire) for i in range(len(SHAPES))]
        assert sum(int((a != b).sum()) for a, b in zip(exact, rounded)) > 100
        assert np.isinf(rounded[0].reshape(-1)[4]) == (wire == "float16")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
def test_extra_stays_float32_and_16_bits_halve_the_bytes(two_ranks, case, path):
    """`extra` comes back as its exact float32 sum (values 16 bits cannot hold), and the
    gradients' bytes on the wire in 16 bits are half of float32's: each rank hands Paddle's
    collectives 2 bytes per gradient element (4 in float32) plus the float32 extra."""
    extra = extra_values(0) + extra_values(1)
    assert not np.array_equal(round_to(extra, "bfloat16"), extra)
    elements = sum(int(np.prod(shape)) for shape in SHAPES)
    extra_bytes = 4 * extra.size
    wire = case.split("_")[0]
    for report in two_ranks:
        assert np.array_equal(report[f"{case}.{path}.extra"], extra)
        counted = {key.rsplit(".", 1)[1]: int(v) for key, v in report.items()
                   if key.startswith(f"{case}.{path}.bytes.")}
        if wire == "float32":
            assert counted == {"float32": 4 * elements + extra_bytes}
        else:
            assert counted == {wire: 2 * elements, "float32": extra_bytes}


@pytest.mark.parametrize("case", CASES)
def test_the_first_all_reduce_starts_before_the_backward_ends(two_ranks, case):
    """backward and thread: the backward's last gradient is held (a gate on its path, see
    grad_sync_ranks.gate) until the first collective starts, so the backward can end only
    after a bucket's all-reduce started from its hooks (the gate waits GATE_SECONDS at most:
    hooks that sent nothing show as a late release); after and flat start none before the
    backward has returned. The hooks sent every bucket (the held gradient's too, after the
    gate, still in the backward); gloo's all-reduce in the backward's thread is all exposed,
    the thread's partly hidden (the gate's HOLD_SECONDS after the first start)."""
    for report in two_ranks:
        for path in PATHS:
            first, end = report[f"{case}.{path}.first_collective_s"], report[f"{case}.{path}.backward_end_s"]
            if path in ("backward", "thread"):
                gate = report[f"{case}.{path}.gate_s"]
                assert first < gate < end and gate - first < GATE_SECONDS / 2, path
            else:
                assert end < first, path
        buckets = int(report[f"{case}.backward.buckets"])
        assert buckets >= 2
        for path in ("backward", "thread"):
            assert report[f"{case}.{path}.timing.in_backward"] == buckets, path
        assert report[f"{case}.after.timing.in_backward"] == 0
        for path in ("backward", "after"):
            assert report[f"{case}.{path}.timing.hidden_s"] == 0.0
            assert report[f"{case}.{path}.timing.ran_s"] == report[f"{case}.{path}.timing.waited_s"] > 0
        ran, hidden, waited = (report[f"{case}.thread.timing.{k}_s"]
                               for k in ("ran", "hidden", "waited"))
        assert 0 < hidden <= ran and ran - hidden <= waited + 1e-9


def test_a_trainer_step_in_each_grad_sync_mode(two_ranks):
    """Optimizer.grad_allreduce_dtype=float16, grad_sync backward, thread and after: each step
    is applied with a finite loss; every mode's backbones equal bit for bit on both ranks and
    across modes (the same sums); every backbone gradient element went in 2 bytes (the head's
    collectives send no float16); the step timers' record splits the gradient all-reduces
    into exposed (inside the collectives phase) and hidden parts: the run not hidden is at
    most the exposed time (which also holds the thread's hand-over latency)."""
    start = {n: p.numpy() for n, p in make_backbone(0).named_parameters()}
    r0, r1 = two_ranks
    for report in two_ranks:
        for mode in MODES:
            t = f"trainer.{mode}."
            assert report[t + "applied"] == 1 and np.isfinite(report[t + "loss"])
            assert report[t + "bytes.float16"] == 2 * report[t + "grad_elements"]
            ran, exposed, hidden = (report[t + f"step.grad_sum_{k}_s"]
                                    for k in ("ran", "exposed", "hidden"))
            assert ran > 0 and 0 <= exposed <= report[t + "step.collectives"]
            assert 0 <= hidden <= ran and ran - hidden <= exposed + 1e-9
            assert (report[t + "step.grad_sum_buckets_in_backward"] > 0) == (mode != "after")
        assert report["trainer.backward.step.grad_sum_hidden_s"] == 0.0
    for name, value in start.items():
        a = r0[f"trainer.backward.backbone.{name}"]
        for mode in MODES:
            for report in two_ranks:
                assert np.array_equal(report[f"trainer.{mode}.backbone.{name}"], a), (mode, name)
    assert any(not np.array_equal(r0[f"trainer.backward.backbone.{n}"], v) for n, v in start.items())
