"""The kernel sets by name, the one place they are spelled, and the choice among them
(`PLSC_KERNELS`). No Paddle import: the config checks the choice at load."""
import os

from ..names import did_you_mean

__all__ = ["KERNELS_ENV", "KERNEL_SETS", "kernel_set"]

KERNELS_ENV = "PLSC_KERNELS"  # "device": every tensor takes the device set (Paddle ops only)
KERNEL_SETS = ("auto", "device")


def kernel_set():
    """The kernel set asked for by PLSC_KERNELS: "auto" (by the tensor's place) or "device";
    another value is a ValueError with the closest name."""
    value = os.environ.get(KERNELS_ENV, "").strip().lower() or "auto"
    if value not in KERNEL_SETS:
        raise ValueError(f"{KERNELS_ENV}={value!r}: expected one of {', '.join(KERNEL_SETS)}"
                         f"{did_you_mean(value, KERNEL_SETS, listed=False)}")
    return value
