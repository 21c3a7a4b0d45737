"""CPU set-up: MKL's dispatch on AMD processors (the threads: test_threads.py), the device choice."""
import os
import subprocess
import sys

import paddle  # noqa: F401  -- imported, so that the late-dispatch warning is due
import pytest

from plsc.process import runtime

AMD = ("AuthenticAMD", {"sse4_2", "avx", "avx2", "fma"})


def test_dispatch_is_set_only_for_amd_with_avx2_and_not_against_the_user():
    env = {}
    with pytest.warns(UserWarning, match="after Paddle was imported"):
        note = runtime.blas_dispatch(env, cpu=AMD)
    assert env == {"MKL_DEBUG_CPU_TYPE": "5"} and "PLSC_MKL_DISPATCH=keep" in note
    for env, cpu in [({}, ("GenuineIntel", {"avx2"})), ({}, ("AuthenticAMD", {"avx"})),
                     ({"PLSC_MKL_DISPATCH": "keep"}, AMD), ({"MKL_DEBUG_CPU_TYPE": "2"}, AMD)]:
        before = dict(env)
        assert runtime.blas_dispatch(env, cpu=cpu) is None
        assert env == before


def test_import_plsc_sets_it_before_paddle_and_keep_turns_it_off():
    code = "import sys, os, plsc; print(os.environ.get('MKL_DEBUG_CPU_TYPE'), 'paddle' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_DEBUG_CPU_TYPE", "PLSC_MKL_DISPATCH")}
    vendor, flags = runtime._cpu_flags()
    expect = "5" if vendor == "AuthenticAMD" and "avx2" in flags else "None"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout
    assert out.split() == [expect, "False"]  # set, and Paddle not imported by `import plsc`
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, PLSC_MKL_DISPATCH="keep"),
                         capture_output=True, text=True).stdout
    assert out.split() == ["None", "False"]


# ------------------------------------------------- the device choice, with the device faked
@pytest.fixture
def fake_devices(monkeypatch):
    """Paddle's device query answers `state["gpus"]` GPUs (a CUDA build when > 0); the device
    set and malloc's set-up are recorded instead of done."""
    state = {"gpus": 0, "set": [], "malloc": 0}
    monkeypatch.setattr(paddle.device, "is_compiled_with_cuda", lambda: state["gpus"] > 0)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: state["gpus"])
    monkeypatch.setattr(paddle, "set_device", lambda name: state["set"].append(name))
    monkeypatch.setattr(paddle, "get_device", lambda: state["set"][-1])
    monkeypatch.setattr(runtime, "keep_freed_memory",
                        lambda: state.__setitem__("malloc", state["malloc"] + 1))
    monkeypatch.setattr(runtime, "set_cpu_threads", lambda n=None: None)
    monkeypatch.delenv("FLAGS_selected_gpus", raising=False)
    return state


def test_auto_and_gpu_take_the_gpu_that_paddle_sees(fake_devices, monkeypatch):
    fake_devices["gpus"] = 2
    assert runtime.select_device("auto") == "gpu:0"
    assert runtime.select_device("gpu") == "gpu:0"
    monkeypatch.setenv("FLAGS_selected_gpus", "1,0")  # the launcher's choice for this rank
    assert runtime.select_device("auto") == "gpu:1"
    assert runtime.select_device("cpu") == "cpu"  # asked for explicitly
    assert fake_devices["set"] == ["gpu:0", "gpu:0", "gpu:1", "cpu"]
    assert fake_devices["malloc"] == 1  # malloc is set up for the CPU run only


def test_no_gpu_means_cpu_for_auto_and_an_error_for_gpu(fake_devices):
    from plsc.config import ConfigError
    assert runtime.select_device("auto") == "cpu" and fake_devices["malloc"] == 1
    with pytest.raises(ConfigError, match="Global.device is gpu but this Paddle build sees no GPU"):
        runtime.select_device("gpu")
    fake_devices["gpus"] = 0  # a CUDA build without a visible GPU counts as none too
    paddle.device.is_compiled_with_cuda = lambda: True
    with pytest.raises(ConfigError, match="sees no GPU"):
        runtime.select_device("gpu")
    assert fake_devices["set"] == ["cpu"]
