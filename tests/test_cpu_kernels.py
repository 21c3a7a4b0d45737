"""plsc's CPU kernels (PReLU on oneDNN, numpy row dot products) against Paddle's kernels and float64."""
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from plsc.kernels import cpu_kernels

from plsc.process import runtime
from plsc.models import blocked
from plsc.models import prelu as prelu_module
from plsc.models.prelu import PReLU, prelu

F = paddle.nn.functional


@pytest.fixture
def threads():
    """Run a test body under a given kernel-thread count, then restore Paddle's."""
    before = runtime.kernel_threads()

    def set_to(n):
        runtime.set_cpu_threads(n)
    yield set_to
    runtime.set_cpu_threads(before)


def _run(fn, x, a, g):
    x = paddle.to_tensor(x, stop_gradient=False)
    a = paddle.to_tensor(a, stop_gradient=False)
    y = fn(x, a)
    y.backward(paddle.to_tensor(g))
    return y.numpy(), x.grad.numpy(), a.grad.numpy()


def _oracle(x, a, g):
    """PReLU and its gradients in float64, channel axis 1 (or one shared slope)."""
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    ab = a.astype(np.float64).reshape([1, -1] + [1] * (x.ndim - 2)) if a.size > 1 else a[0]
    y = np.where(x64 > 0, x64, ab * x64)
    dx = np.where(x64 > 0, g64, ab * g64)
    contrib = np.where(x64 > 0, 0.0, g64 * x64)
    axes = (0,) + tuple(range(2, x.ndim))
    da = contrib.sum(axis=axes) if a.size > 1 else contrib.sum(keepdims=True).reshape(1)
    return y, dx, da


CASES = [([6, 16, 20, 20], 16), ([5, 7, 3, 2], 7), ([9, 6], 6), ([4, 3, 5], 1),
         ([3, 300, 2, 2], 300), ([2, 4, 6, 6], 1)]


@pytest.mark.parametrize("shape,slopes", CASES)
def test_prelu_equals_paddles_kernel_and_float64(shape, slopes, threads):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[:7] = [0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 0.0]
    g = rng.standard_normal(shape).astype(np.float32)
    a = rng.uniform(0, 1, slopes).astype(np.float32)
    if a.size > 1:
        a[:2] = [0.0, 1.0]  # both ends of the kernels' range
    ref = _run(F.prelu, x, a, g)
    oracle = _oracle(x, a, g)
    for n in (1, 2, 3):
        threads(n)
        y, dx, da = _run(prelu, x, a, g)
        # equal values (a zero product, slope 0 on x < 0, may be +0 where Paddle has -0)
        assert np.array_equal(y, ref[0]) and np.array_equal(dx, ref[1])
        assert np.array_equal(y, oracle[0].astype(np.float32))  # a product rounds once
        np.testing.assert_allclose(da, oracle[2], rtol=2e-5, atol=1e-4)
        if n == 1:
            da_1 = da
        else:
            assert np.array_equal(da, da_1)  # the thread count does not change the sum


def test_prelu_takes_any_slope_and_falls_back_outside_its_kernels(monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.standard_normal([3, 4, 5, 5]).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    a = np.array([-0.5, 0.2, 1.5, 0.3], np.float32)  # outside [0, 1]: oneDNN's kernel still
    ref = _run(F.prelu, x, a, g)
    y, dx, da = _run(prelu, x, a, g)
    assert np.array_equal(y, ref[0]) and np.array_equal(dx, ref[1])
    np.testing.assert_allclose(da, _oracle(x, a, g)[2], rtol=1e-4, atol=1e-4)
    # channels-last, float64 and a slope count that is neither 1 nor C go to Paddle's kernel
    monkeypatch.setattr(prelu_module._OneDNNPReLU, "apply",
                        lambda *args: pytest.fail("oneDNN's PReLU ran"))
    xl = paddle.to_tensor(np.moveaxis(x, 1, 3).copy())
    out = prelu(xl, paddle.to_tensor(np.abs(a) / 2), data_format="NHWC")
    ref = F.prelu(xl, paddle.to_tensor(np.abs(a) / 2), data_format="NHWC")
    assert np.array_equal(out.numpy(), ref.numpy())
    x64, a64 = paddle.to_tensor(x.astype(np.float64)), paddle.to_tensor(a.astype(np.float64))
    assert np.array_equal(prelu(x64, a64).numpy(), F.prelu(x64, a64).numpy())
    with pytest.raises(AssertionError, match="weight size"):  # Paddle's own check
        prelu(paddle.to_tensor(x), paddle.to_tensor(a[:2]))


def test_prelu_layer_keeps_paddles_parameter_and_exports():
    layer = PReLU(8)
    assert list(layer.state_dict()) == list(paddle.nn.PReLU(8).state_dict())
    x = paddle.randn([2, 8, 3, 3])
    static = paddle.jit.to_static(layer, full_graph=True)
    assert np.array_equal(static(x).numpy(), F.prelu(x, layer._weight).numpy())


def test_row_dot_against_float64_sliced_and_threaded(threads):
    rng = np.random.default_rng(2)
    a = rng.standard_normal([5000, 96]).astype(np.float32)
    b = rng.standard_normal([5000, 96]).astype(np.float32)
    expect = np.einsum("ij,ij->i", a.astype(np.float64), b.astype(np.float64))
    ta, tb = paddle.to_tensor(a), paddle.to_tensor(b)
    results = []
    for n in (1, 2):
        threads(n)
        got = cpu_kernels.row_dot(ta, tb).numpy()
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-4)
        results.append(got)
    assert np.array_equal(results[0], results[1])
    part = cpu_kernels.row_dot(ta[1234:1300], tb[1234:1300]).numpy()  # a row is the same alone
    assert np.array_equal(part, results[0][1234:1300])
    cols = cpu_kernels.row_dot(ta[:, 10:50], tb[:, 10:50]).numpy()  # a strided view
    np.testing.assert_allclose(cols, np.einsum("ij,ij->i", a[:, 10:50].astype(np.float64),
                                               b[:, 10:50].astype(np.float64)), rtol=1e-5,
                               atol=1e-4)
    wide = cpu_kernels.row_dot(ta.astype("float64"), tb.astype("float64"))  # Paddle's kernel
    assert wide.dtype == paddle.float64
    np.testing.assert_allclose(wide.numpy(), expect, rtol=1e-12)


def test_keep_freed_memory_keeps_large_blocks_and_can_be_left_off():
    """A freed 256 MiB tensor: with malloc left alone it is unmapped (the resident set drops
    by its size, and a refill faults its pages in again); kept, the resident set does not
    drop. Whether a kept block is then reused for the next one depends on where malloc's
    aligned requests fall (about one process in eight takes fresh heap for each refill, with
    or without plsc's code), so reuse is not asserted."""
    assert runtime.keep_freed_memory({"PLSC_MALLOC": "keep"}).startswith("malloc: left as it is")
    code = ("import plsc, paddle, numpy as np\n"
            "from plsc.process import runtime\n"
            "import resource, sys\n"
            "if sys.argv[1] == 'on': runtime.keep_freed_memory({})\n"
            "def anon():\n"
            "    for line in open('/proc/self/status'):\n"
            "        if line.startswith('RssAnon:'): return int(line.split()[1]) << 10\n"
            "drops, faults = [], []\n"
            "for _ in range(3):\n"
            "    minor = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "    t = paddle.empty([64 << 20])\n"  # 256 MiB
            "    np.from_dlpack(t).fill(1)\n"
            "    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - minor)\n"
            "    before = anon()\n"
            "    del t\n"
            "    drops.append(before - anon())\n"
            "print(min(faults[1:]), min(drops))\n")
    got = {}
    for mode in ("off", "on"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                             env=dict(os.environ, PLSC_MALLOC=""))
        got[mode] = [int(v) for v in out.stdout.split()[-2:]]
    pages = (256 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert got["off"][0] > pages // 2  # unmapped and faulted in again
    assert got["off"][1] > (200 << 20)  # the resident set dropped by the block
    assert got["on"][1] < (25 << 20)  # kept


@pytest.fixture(params=["numpy", "paddle"])
def path(request, monkeypatch):
    """Each head kernel on its numpy path (the CPU set) and on Paddle's ops (the device set,
    as on other devices), whatever PLSC_KERNELS says outside."""
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "device" if request.param == "paddle" else "auto")
    return request.param


def test_head_kernels_against_float64(path, threads):
    rng = np.random.default_rng(3)
    buf = rng.standard_normal([37, 1000]).astype(np.float32) * 4
    scale = rng.uniform(0.5, 2, 1000).astype(np.float32)
    shift = rng.standard_normal(37).astype(np.float32) + 6
    for n in (1, 2):
        threads(n)
        t = paddle.to_tensor(buf)
        assert cpu_kernels.scale_columns_(t, paddle.to_tensor(scale)) is t
        assert np.array_equal(t.numpy(), buf * scale)  # one rounding per product
        assert np.array_equal(cpu_kernels.row_max(t).numpy(), (buf * scale).max(axis=1))
        # a fixed shift
        t = paddle.to_tensor(buf)
        m, total = cpu_kernels.exp_shifted_(t, paddle.to_tensor(shift))
        e = np.exp(buf.astype(np.float64) - shift[:, None])
        np.testing.assert_allclose(t.numpy(), e, rtol=2e-6)
        np.testing.assert_allclose(total.numpy(), e.sum(axis=1), rtol=1e-5)
        assert np.array_equal(m.numpy(), shift)
        # a running max: the larger of the shift and the row's max
        t = paddle.to_tensor(buf)
        m, total = cpu_kernels.exp_shifted_(t, paddle.to_tensor(shift), running=True)
        expect_m = np.maximum(shift, buf.max(axis=1))
        assert np.array_equal(m.numpy(), expect_m)
        e = np.exp(buf.astype(np.float64) - expect_m[:, None])
        np.testing.assert_allclose(t.numpy(), e, rtol=2e-6)
        np.testing.assert_allclose(total.numpy(), e.sum(axis=1), rtol=1e-5)
        t = paddle.to_tensor(buf)
        assert cpu_kernels.exp_shifted_(t, paddle.to_tensor(shift), want_sum=False)[1] is None
        # the component along w removed from each row of g
        g = rng.standard_normal([300, 64]).astype(np.float32)
        w = rng.standard_normal([300, 64]).astype(np.float32)
        inv = (1 / np.linalg.norm(w.astype(np.float64), axis=1)).astype(np.float32)
        tg = paddle.to_tensor(g)
        cpu_kernels.remove_row_components_(tg, paddle.to_tensor(w), paddle.to_tensor(inv))
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        expect = g64 - w64 * (np.einsum("ij,ij->i", w64, g64) * inv.astype(np.float64) ** 2)[:, None]
        np.testing.assert_allclose(tg.numpy(), expect, rtol=1e-4, atol=1e-5)
        assert np.abs(np.einsum("ij,ij->i", tg.numpy().astype(np.float64), w64)).max() < 1e-4


def _paddle_prelu(x, slope):
    """Paddle's own prelu, a blocked activation (`plsc.models.blocked`) taken to the plain
    layout and back."""
    if not blocked.is_blocked(x):
        return F.prelu(x, slope)
    return blocked.to_blocked(F.prelu(blocked.to_plain(x), slope))


def test_backbone_gradients_equal_those_with_paddles_prelu(threads):
    """A whole IResNet step with plsc's PReLU against the same weights on Paddle's PReLU."""
    from plsc.models import build_model
    threads(2)
    paddle.seed(5)
    model = build_model("IResNetTiny", embedding_size=32, input_size=(28, 28))
    x = paddle.randn([4, 3, 28, 28])
    target = paddle.randn([4, 32])
    grads = []
    for swap in (False, True):
        if swap:  # the same parameters, Paddle's own kernel (on the plain layout)
            for layer in model.sublayers():
                if isinstance(layer, PReLU):
                    layer.forward = lambda t, layer=layer: _paddle_prelu(t, layer._weight)
        out = model(x)
        (out - target).square().sum().backward()
        grads.append({n: p.grad.numpy() for n, p in model.named_parameters()
                      if p.grad is not None})
        model.clear_gradients(set_to_zero=False)
    assert grads[0].keys() == grads[1].keys()
    assert any(n.endswith("prelu._weight") for n in grads[0])
    for name, g in grads[1].items():
        np.testing.assert_allclose(grads[0][name], g, rtol=1e-4, atol=1e-4 * np.abs(g).max(),
                                   err_msg=name)


def test_take_rows_against_numpy_indexing(path, threads):
    """Rows picked by index (repeats, any order), float32 and 16-bit bits, into a given
    output or a new one; an index out of range is an error, not a clipped row."""
    from plsc.storage import gather_rows
    rng = np.random.default_rng(4)
    src = rng.standard_normal([3000, 24]).astype(np.float32)
    index = rng.integers(0, 3000, 2500)
    index[:3] = [2999, 0, 2999]
    for n in (1, 2):
        threads(n)
        got = cpu_kernels.take_rows(paddle.to_tensor(src), paddle.to_tensor(index))
        assert np.array_equal(got.numpy(), src[index])
        out = paddle.full([2500, 24], 7.0)
        back = cpu_kernels.take_rows(paddle.to_tensor(src), paddle.to_tensor(index), out=out)
        assert np.array_equal(out.numpy(), src[index])
        assert back.data_ptr() == out.data_ptr()
        half = paddle.to_tensor(src).astype("bfloat16")
        picked = gather_rows(half, paddle.to_tensor(index.astype(np.int32)))
        assert picked.dtype == paddle.bfloat16
        assert np.array_equal(picked.astype("float32").numpy(),
                              half.astype("float32").numpy()[index])
    if path == "numpy":  # Paddle's own gather has its own range error
        with pytest.raises(IndexError, match=r"\[0, 3000\)"):
            cpu_kernels.take_rows(paddle.to_tensor(src), paddle.to_tensor([5, 3000]))


@pytest.mark.parametrize("mkl", [True, False])
def test_exp_with_and_without_mkl_against_float64(mkl, monkeypatch):
    """exp in place through MKL's vsExp (Paddle's bundled MKL) and through numpy's fallback."""
    if mkl:
        fn = cpu_kernels._load_vs_exp()
        if fn is None:
            pytest.skip("this Paddle build bundles no MKL")
        monkeypatch.setattr(cpu_kernels, "_VS_EXP", [fn])
    else:
        monkeypatch.setattr(cpu_kernels, "_VS_EXP", [None])
    rng = np.random.default_rng(6)
    a = (rng.standard_normal([7, 1001]) * 30).astype(np.float32)
    a[0, :4] = [0.0, -104.0, 88.0, -np.inf]
    with np.errstate(over="ignore"):
        expect = np.exp(a.astype(np.float64)).astype(np.float32)  # inf above 88.7, as float32
    got = a.copy()
    cpu_kernels._exp_(got)
    np.testing.assert_allclose(got, expect, rtol=3e-7, atol=2e-45)
    strided = a.copy()[:, ::2]  # not contiguous: numpy's exp
    with np.errstate(over="ignore"):
        cpu_kernels._exp_(strided)
    np.testing.assert_allclose(strided, expect[:, ::2], rtol=3e-7, atol=2e-45)


def test_copy_columns_against_numpy(path, threads):
    """A column slab copied (and scaled) into a given output of its shape, else a new one."""
    rng = np.random.default_rng(7)
    buf = rng.standard_normal([37, 500]).astype(np.float32)
    scale = rng.uniform(0.5, 2, 500).astype(np.float32)
    t, s = paddle.to_tensor(buf), paddle.to_tensor(scale)
    for n in (1, 2):
        threads(n)
        plain = cpu_kernels.copy_columns(t, 100, 230)
        assert plain.shape == [37, 130] and np.array_equal(plain.numpy(), buf[:, 100:230])
        scaled = cpu_kernels.copy_columns(t, 100, 230, s[100:230], out=plain)
        assert np.array_equal(scaled.numpy(), buf[:, 100:230] * scale[100:230])
        if path == "numpy":
            assert scaled.data_ptr() == plain.data_ptr()  # the given output, reused
        other = cpu_kernels.copy_columns(t, 0, 7, s[:7], out=plain)  # another width: new
        assert np.array_equal(other.numpy(), buf[:, :7] * scale[:7])
    assert np.array_equal(t.numpy(), buf)  # the source is untouched


def test_put_columns_against_numpy(path, threads):
    """A column slab written into a wider array in place, the other columns untouched."""
    rng = np.random.default_rng(8)
    buf = rng.standard_normal([37, 500]).astype(np.float32)
    part = rng.standard_normal([37, 130]).astype(np.float32)
    for n in (1, 2):
        threads(n)
        t = paddle.to_tensor(buf)
        got = cpu_kernels.put_columns_(t, 100, paddle.to_tensor(part))
        want = buf.copy()
        want[:, 100:230] = part
        assert got is t and np.array_equal(t.numpy(), want)
