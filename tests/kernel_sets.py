"""Run tests on both kernel sets: the CPU set (numpy kernels on CPU tensors) and the device set
(`PLSC_KERNELS=device`: Paddle ops only, what a GPU runs; `plsc.cpu_kernels.cpu_set`).

- `from kernel_sets import both_kernel_sets  # noqa` runs every test of a module on both;
- `from kernel_sets import kernels` with `pytestmark = pytest.mark.usefixtures("kernels")`
  does the same, and a test can take `kernels` as an argument to learn its set."""
import pytest

from plsc.cpu_kernels import KERNELS_ENV

KERNEL_SETS = ("cpu", "device")


def _use(monkeypatch, kernel_set):
    monkeypatch.setenv(KERNELS_ENV, "device" if kernel_set == "device" else "auto")
    return kernel_set


@pytest.fixture(params=KERNEL_SETS)
def kernels(request, monkeypatch):
    """The kernel set the test runs on ("cpu" or "device")."""
    return _use(monkeypatch, request.param)


@pytest.fixture(autouse=True, params=KERNEL_SETS)
def both_kernel_sets(request, monkeypatch):
    """Every test of the importing module, once on each kernel set."""
    return _use(monkeypatch, request.param)
