"""Run a test module on both kernel sets: `from kernel_sets import both_kernel_sets  # noqa`
makes every test of the module run once with the CPU set (numpy kernels on CPU tensors) and
once with `PLSC_KERNELS=device` (Paddle ops only, what a GPU runs)."""
import pytest

from plsc.cpu_kernels import KERNELS_ENV


@pytest.fixture(autouse=True, params=["cpu", "device"])
def both_kernel_sets(request, monkeypatch):
    if request.param == "device":
        monkeypatch.setenv(KERNELS_ENV, "device")
    else:
        monkeypatch.delenv(KERNELS_ENV, raising=False)
    return request.param
