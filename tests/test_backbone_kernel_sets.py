"""A whole backbone step on the CPU kernel set (oneDNN convolutions, the GEMM Linear, numpy
permutes and PReLU) against the same weights on the device set (Paddle's own ops only, what a
GPU runs): the same embeddings and the same gradient for every parameter."""
import numpy as np
import paddle
import pytest

from plsc.kernels.cpu_kernels import KERNELS_ENV
from plsc.models import build_model

BACKBONES = [
    ("IResNetTiny", dict(input_size=28, embedding_size=32)),
    ("MobileFaceNet", dict(blocks=(1, 2, 1, 1), input_size=32, embedding_size=32)),
    ("vit_t", dict(input_size=36, patch_size=9, embedding_size=32, depth=2)),
]


@pytest.mark.parametrize("name,kwargs", BACKBONES, ids=[b[0] for b in BACKBONES])
def test_step_equals_device_set(name, kwargs, monkeypatch):
    paddle.seed(9)
    model = build_model(name, **kwargs)
    x = paddle.randn([4, 3, kwargs["input_size"], kwargs["input_size"]])
    target = paddle.randn([4, kwargs["embedding_size"]])
    results = []
    for kernel_set in ("auto", "device"):
        monkeypatch.setenv(KERNELS_ENV, kernel_set)
        paddle.seed(3)  # the same drop-path and token-mask draws on both sets
        out = model(x)
        (out - target).square().sum().backward()
        grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.numpy(), grads))
        model.clear_gradients(set_to_zero=False)
    (out_cpu, g_cpu), (out_dev, g_dev) = results
    np.testing.assert_allclose(out_cpu, out_dev, rtol=1e-4, atol=1e-4 * np.abs(out_dev).max())
    trainable = [n for n, p in model.named_parameters() if not p.stop_gradient]
    assert sorted(g_cpu) == sorted(g_dev) == sorted(trainable)
    scale = max(float(np.abs(g).max()) for g in g_dev.values())  # some are ~0 in theory
    for n, g in g_dev.items():
        np.testing.assert_allclose(g_cpu[n], g, rtol=1e-3, atol=1e-5 * scale, err_msg=n)
