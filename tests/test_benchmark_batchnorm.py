"""benchmarks/benchmark_batchnorm.py's kernels (Paddle's batch_norm and the candidates it times
against it: oneDNN's, blocked and plain, and numpy's) compute batch norm's training forward and
backward: each against batch norm written in float64 numpy, so the benchmark compares correct
kernels. Channel counts off the block width (20) and one value per channel and image (1 x 1)
included; the input's mean is large next to its spread, where a one-pass variance would lose
digits. Tolerance: float32 sums over at most 315 values per channel, rtol 1e-4 and atol 1e-5
of the largest value (the errors measured are at most 1.1e-5 of it, in dx with 5 values per
channel: the float32 rounding of x - mean where the mean is 40 times the spread)."""
import time

import numpy as np
import paddle
import pytest

from plsc.kernels import onednn
from scripts import load

bench = load("benchmarks/benchmark_batchnorm.py")


def oracle(x, w, b, dy, eps):
    """(y, dx, dw, db) of training batch norm over axes N, H, W, in float64."""
    x, w, b, dy = (np.asarray(a, np.float64) for a in (x, w, b, dy))
    axes, ch = (0, 2, 3), (slice(None), None, None)
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    inv = 1.0 / np.sqrt(var + eps)
    xhat = (x - mean[ch]) * inv[ch]
    db, dw = dy.sum(axis=axes), (dy * xhat).sum(axis=axes)
    n = x.size // x.shape[1]
    dx = (w * inv / n)[ch] * (n * dy - db[ch] - xhat * dw[ch])
    return xhat * w[ch] + b[ch], dx, dw, db


@pytest.mark.parametrize("shape", [(3, 20, 5, 7), (5, 16, 1, 1), (4, 8, 9, 9)])
def test_every_kernel_is_batch_norm(shape):
    rng = np.random.RandomState(sum(shape))
    x = (rng.normal(size=shape) * rng.uniform(0.5, 3, size=(1, shape[1], 1, 1)) + 40)
    x, dy = x.astype(np.float32), rng.normal(size=shape).astype(np.float32)
    w, b = rng.uniform(0.5, 2, shape[1]).astype(np.float32), rng.normal(size=shape[1]) \
        .astype(np.float32)
    want = oracle(x, w, b, dy, bench.EPS)
    tensors = [paddle.to_tensor(a) for a in (x, w, b, dy)]
    for t in tensors[:3]:
        t.stop_gradient = False
    kernels = bench.kernels(list(shape)) if onednn.available() else None
    if kernels is None:
        pytest.skip("no oneDNN")
    assert set(kernels) == {"paddle", "onednn_blocked", "onednn_plain", "numpy"}
    for name, kernel in kernels.items():
        got = kernel(*tensors, time.perf_counter)[0]
        for what, g, r in zip(("y", "dx", "dw", "db"), got, want):
            np.testing.assert_allclose(g.numpy(), r, rtol=1e-4, atol=1e-5 * np.abs(r).max(),
                                       err_msg=f"{name} {what}")
