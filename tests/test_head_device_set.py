"""The head's device kernel set (PLSC_KERNELS=device: Paddle ops only, what a GPU runs) on this
CPU: it agrees with the CPU set, launches a bounded number of ops (benchmarks/
benchmark_launches.py's count), runs no numpy kernel, never makes a float32 copy of a wide
narrow weight, and the seeded sampler's device branch restores both generators."""
import plsc  # noqa: F401  (before Paddle: it sets MKL's code path)
import numpy as np
import paddle
import pytest

from oracles import make_case
from plsc.kernels import cpu_kernels
from plsc.loss import AdaFace, ArcFace, CosFace
from plsc.nn import PartialFC
from plsc.nn import parallel_softmax as ps
from plsc.nn import sampling
from plsc.optim import SparseAdamW, SparseMomentum

from scripts import load

launches = load("benchmarks/benchmark_launches.py")
count_ops = launches.count_ops
step_counts = launches.step_counts

# The two sets compute the same float32 operations in a different order (numpy/MKL row
# reductions in slabs of rows vs Paddle's reductions; MKL's vsExp vs Paddle's exp, both within
# an ulp or two): a loss or a gradient entry sums at most C·N products of such values, so the
# difference is float32 reduction-order error, a few ulps relative to the sum's magnitude (for
# the loss, relative to the logits' magnitude s: measured here at most 1.8e-7·s, the
# gradients at most 1.7e-6 of their largest entry). 2e-6 of that magnitude (16 float32 ulps)
# bounds it; a real difference (a wrong mask, margin or gradient) is orders of magnitude
# larger.
SET_TOLERANCE = 2e-6


def _step(margin, x, y, w, kernels, monkeypatch, dtype="float32", **kw):
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "device" if kernels == "device" else "auto")
    head = PartialFC(x.shape[1], w.shape[0], margin, param_dtype=dtype, **kw)
    head.weight.set_value(paddle.to_tensor(w).astype(dtype))
    xt = paddle.to_tensor(x)
    xt.stop_gradient = False
    loss = head(xt, paddle.to_tensor(y))
    loss.backward()
    grad = head.sampled_weight.grad if head.sampled_index is not None else head.weight.grad
    return {"loss": loss.numpy(), "dx": xt.grad.numpy(),
            "dw": grad.astype("float32").numpy()}


HEADS = {"dense": dict(chunk_size=0), "chunked": dict(chunk_size=13),
         "pfc": dict(sample_ratio=0.4, chunk_size=0),
         # the device budget lowered to 20 rows (3 slabs of the 57), no workspace buffers
         "dense-slabs": dict(chunk_size=0, reuse_buffers=False)}
MARGIN_CASES = {"arcface": lambda: ArcFace(), "cosface": lambda: CosFace(),
                "arcface-filter": lambda: ArcFace(), "adaface": lambda: AdaFace()}


@pytest.mark.parametrize("head", sorted(HEADS))
@pytest.mark.parametrize("margin", sorted(MARGIN_CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_set_equals_cpu_set(head, margin, dtype, monkeypatch):
    make, s = MARGIN_CASES[margin], MARGIN_CASES[margin]().scale
    if head == "dense-slabs":
        monkeypatch.setattr(ps, "_DEVICE_WGRAD_BYTES", 20 * 16 * 4)
    kw = dict(HEADS[head])
    if margin == "arcface-filter":
        kw["interclass_filtering_threshold"] = 0.05
    x, y, w, _ = make_case(seed=3, n=12, d=16, num_classes=57, margin=ArcFace())
    # a new margin each run: AdaFace's running statistics move with every forward
    got = {k: _step(make(), x, y, w, k, monkeypatch, dtype, **kw) for k in ("cpu", "device")}
    for key in ("loss", "dx", "dw"):
        a, b = got["cpu"][key], got["device"][key]
        # the loss's error is the logits' (magnitude up to s), not the loss's own magnitude
        ref = max(np.abs(a).max(), s if key == "loss" else 0.0, 1e-30)
        err = np.abs(a - b).max() / ref
        assert err <= SET_TOLERANCE, (key, err)


def _head_counts(classes, monkeypatch, d=16, batch=8, ratio=1.0, chunk=0, opt=None,
                 dtype="float32"):
    """Top-level ops of a head step's forward + backward (and of the update) on the device
    set, after a warm-up step."""
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "device")
    head = PartialFC(d, classes, ArcFace(), sample_ratio=ratio, chunk_size=chunk,
                     param_dtype=dtype)
    rng = np.random.RandomState(0)
    x = paddle.to_tensor(rng.normal(size=(batch, d)).astype("float32"))
    x.stop_gradient = False
    y = paddle.to_tensor(rng.randint(0, classes, batch).astype("int64"))

    def step():
        head(x, y).backward()

    def update():
        if opt is not None:
            opt.step(head)
        else:
            head.release_sampled_rows()
        x.grad = None
        head.drop_dense_gradients()
    step()
    update()
    counts = count_ops(step)["top"]
    return counts, count_ops(update)["top"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_partial_fc_count_does_not_grow_with_the_classes(dtype, monkeypatch):
    """Its sampled rows are one slab of the device budget (here lowered so that the larger
    shard's 5,000 rows of d = 16 are just inside it, the narrow gather included)."""
    monkeypatch.setattr(ps, "_DEVICE_WGRAD_BYTES", 5_000 * 16 * 4)
    monkeypatch.setattr(cpu_kernels, "DEVICE_SLAB_BYTES", 5_000 * 16 * 4)
    from plsc import storage
    monkeypatch.setattr(storage, "DEVICE_SLAB_BYTES", 5_000 * 16 * 4)
    small = _head_counts(2_000, monkeypatch, ratio=0.1, dtype=dtype)[0]
    large = _head_counts(50_000, monkeypatch, ratio=0.1, dtype=dtype)[0]
    assert small == large, (small, large)
    # beyond the budget the count grows a slab at a time
    assert _head_counts(100_000, monkeypatch, ratio=0.1, dtype=dtype)[0] > large


# The trainer's own head step on the device set (Partial FC 0.1, the update inside the
# backward, its label check): top-level ops of forward + backward + end_fused_step, as
# `benchmark_launches.py --update fused --check-inputs labels` counts them (issue 48: 146
# and 217 before).
TRAINER_STEP_LIMITS = {("float32", "sgd"): 145, ("bfloat16", "adamw"): 200}


@pytest.mark.parametrize("dtype,opt", sorted(TRAINER_STEP_LIMITS))
def test_trainer_step_count_is_bounded_and_flat(dtype, opt, monkeypatch):
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "device")
    counts = [launches.step_counts("pfc0.1", dtype, opt, classes, d=16, batch=8,
                                   check_inputs="labels", fused=True)["step"]["top"]
              for classes in (2_000, 20_000)]
    assert counts[0] == counts[1] <= TRAINER_STEP_LIMITS[dtype, opt], counts


def test_chunked_count_is_constant_per_block(monkeypatch):
    counts = [_head_counts(64 * k, monkeypatch, chunk=64)[0] for k in (2, 3, 4)]
    assert counts[2] - counts[1] == counts[1] - counts[0] > 0, counts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_count_is_constant_per_slab(dtype, monkeypatch):
    """The dense path's backward (and, for 16-bit storage, its forward) works in slabs of
    `_DEVICE_WGRAD_BYTES` (on the device set) when a block's float32 rows exceed it."""
    monkeypatch.setattr(ps, "_DEVICE_WGRAD_BYTES", 16 * 4 * 32)  # 32 rows of d = 16
    counts = [_head_counts(32 * k, monkeypatch, dtype=dtype)[0] for k in (3, 4, 5)]
    assert counts[2] - counts[1] == counts[1] - counts[0] > 0, counts


def test_no_numpy_kernel_runs_on_the_device_set(monkeypatch):
    """With PLSC_KERNELS=device every numpy kernel's entry (`as_numpy`, imported by name in
    several modules) raises: a head step of each kind and storage, and its update, run."""
    def refuse(t):
        raise AssertionError("a numpy kernel ran on the device set")
    import plsc.storage.int8
    for mod in (cpu_kernels, ps, plsc.storage.int8):
        monkeypatch.setattr(mod, "as_numpy", refuse)
    for dtype in ("float32", "bfloat16", "int8"):
        for kw in (dict(ratio=0.1), dict(chunk=64), dict()):
            for opt in (SparseMomentum(0.1, momentum=0.9), SparseAdamW(0.001)):
                if dtype == "int8":
                    continue  # an 8-bit weight's gradient needs the fused update (below)
                _head_counts(300, monkeypatch, dtype=dtype, opt=opt, **kw)
        if dtype == "int8":
            monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "device")
            head = PartialFC(16, 300, ArcFace(), sample_ratio=0.1, param_dtype="int8")
            opt = SparseAdamW(0.001, state_dtype="int8")
            x = paddle.randn([8, 16])
            head.row_update = opt.fused_update(head)
            head(x, paddle.randint(0, 300, [8])).backward()
            opt.end_fused_step(head)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_4_bit_state_adds_at_most_20_ops_to_the_8_bit_step(opt, monkeypatch):
    """Issue 47: a step with int8 centres and 4-bit state (the update inside the backward)
    launches at most 20 ops more than the same step with 8-bit state, Partial FC at two class
    counts (the difference flat) and dense; d = 256, two blocks a row, as at d = 512."""
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "device")
    diffs = []
    for head, classes in (("pfc0.1", 2_000), ("pfc0.1", 6_000), ("dense", 2_000)):
        top = {dtype: step_counts(head, dtype, opt, classes, d=256, batch=16,
                                  check_inputs="labels")["step"]["top"]
               for dtype in ("int8", "int8+int4")}
        diffs.append(top["int8+int4"] - top["int8"])
    assert max(diffs) <= 20 and diffs[0] == diffs[1], diffs


def test_wide_narrow_weight_is_read_a_slab_at_a_time(monkeypatch):
    """Dense path on the device set, bfloat16 weight of C·d = 2^21 values (a float32 copy:
    8 MiB), the slab budget lowered to 1 MiB: the allocator's peak during forward and backward
    (the gradient rows handed to a sink, as to the fused update: no weight gradient array)
    stays below half of that float32 copy; reading the shard whole (a 64 MiB budget) exceeds
    it. Measured with
    Paddle's host allocator statistics (`paddle.base.core.host_memory_stat_peak_value`),
    which count every Paddle CPU tensor (the device set makes only Paddle tensors)."""
    from paddle.base import core
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "device")
    monkeypatch.setattr(ps, "_DEVICE_WGRAD_BYTES", 1 << 20)  # slabs of 1 MiB of float32 rows
    c, d, n = 8192, 256, 8
    f32_copy = c * d * 4
    head = PartialFC(d, c, ArcFace(), chunk_size=0, param_dtype="bfloat16")
    x = paddle.randn([n, d])
    x.stop_gradient = False
    y = paddle.randint(0, c, [n])
    seen = []

    def step():  # the gradient rows go to a sink (the optimizer's fused update would take them)
        head.row_update = lambda lo, hi, g_w, g_b: seen.append(hi - lo)
        head(x, y).backward()
        head.row_update = None
        x.grad = None
    step()
    base = core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    step()
    extra = core.host_memory_stat_peak_value("Allocated", 0) - base
    assert extra < f32_copy // 2, (extra, f32_copy)
    assert sum(seen) == 2 * c and max(seen) < c  # every row's gradient, in slabs
    # and the test can fail: the whole block at once makes the float32 copy
    monkeypatch.setattr(ps, "_DEVICE_WGRAD_BYTES", 64 << 20)
    head.workspace.clear()
    step()
    base = core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    step()
    assert core.host_memory_stat_peak_value("Allocated", 0) - base >= f32_copy


def test_seeded_sampler_device_branch(monkeypatch):
    """`sampling._Seeded` on a (faked) GPU also saves and restores the CPU generator, which
    `paddle.seed` reseeds too: the draw is the CPU run's, and both generators go on as if no
    draw had happened."""
    target = paddle.to_tensor([3, 5, -1, 7, 3, 90], dtype="int64")
    expected = sampling.sample_centres(target, 100, 0.1, 1, 2, 0)[0].numpy()
    saved = []
    real = paddle.get_rng_state

    def spy(device=None):
        saved.append(device)
        return real(device) if device is not None else real()
    monkeypatch.setattr(paddle, "get_device", lambda: "gpu:0")
    monkeypatch.setattr(paddle, "get_rng_state", spy)
    state = real("cpu")
    got = sampling.sample_centres(target, 100, 0.1, 1, 2, 0)[0].numpy()
    after = paddle.rand([4]).numpy()
    paddle.set_rng_state(state, device="cpu")
    assert saved == [None, "cpu"]  # the device branch ran
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(after, paddle.rand([4]).numpy())


@pytest.mark.parametrize("kernels", ["cpu", "device"])
def test_num_positive_counts_distinct_owned_labels(kernels, monkeypatch):
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "device" if kernels == "device" else "auto")
    head = PartialFC(4, 50, ArcFace())
    for t in ([-1, 4, 4, -1, 0, 9, 0], [-1, -1], [7], [3, 3, 3]):
        head._last_target = paddle.to_tensor(t, dtype="int64")
        assert head.num_positive == len({v for v in t if v >= 0}), t


def test_remove_row_components_device_equals_numpy(monkeypatch):
    rng = np.random.RandomState(1)
    g, w = rng.normal(size=(300, 7)).astype("float32"), rng.normal(size=(300, 7)).astype("float32")
    inv = (1 / np.linalg.norm(w, axis=1)).astype("float32")
    want = g - w * ((w * g).sum(1) * inv * inv)[:, None]
    for budget in (cpu_kernels.DEVICE_SLAB_BYTES, 7 * 4 * 64):  # one slab; slabs of 64 rows
        monkeypatch.setattr(cpu_kernels, "DEVICE_SLAB_BYTES", budget)
        monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "device")
        got = cpu_kernels.remove_row_components_(paddle.to_tensor(g), paddle.to_tensor(w),
                                                 paddle.to_tensor(inv)).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_prelu_takes_paddles_op_on_the_device_set(monkeypatch):
    """`plsc.models.prelu` asks the kernel switch: with PLSC_KERNELS=device oneDNN's PReLU
    is not used, and the result is Paddle's."""
    from plsc.models import prelu as pr
    x = paddle.randn([2, 3, 4, 4])
    a = paddle.to_tensor([0.25, 0.5, 0.1])
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "auto")
    assert pr._onednn_ok(x, a, "NCHW", False)  # the CPU set would take oneDNN's kernel
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "device")
    monkeypatch.setattr(pr._OneDNNPReLU, "apply", lambda *args: pytest.fail("oneDNN PReLU ran"))
    got = pr.prelu(x, a)
    monkeypatch.undo()
    np.testing.assert_array_equal(got.numpy(),
                                  paddle.nn.functional.prelu(x, a).numpy())
