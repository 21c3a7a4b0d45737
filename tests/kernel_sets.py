"""Run a test module on both kernel sets: `from kernel_sets import kernels` and
`pytestmark = pytest.mark.usefixtures("kernels")` parametrise every test of the module with
PLSC_KERNELS unset-equivalent ("auto": the CPU set on CPU tensors) and "device" (Paddle ops
only, what a GPU runs; `plsc.cpu_kernels.cpu_set`)."""
import pytest

from plsc.cpu_kernels import KERNELS_ENV

KERNEL_SETS = ("cpu", "device")


@pytest.fixture(params=KERNEL_SETS)
def kernels(request, monkeypatch):
    """The kernel set the test runs on ("cpu" or "device")."""
    monkeypatch.setenv(KERNELS_ENV, "device" if request.param == "device" else "auto")
    return request.param
