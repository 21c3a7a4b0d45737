"""Head arrays are saved a slab of rows at a time: the same .npy bytes as numpy's own
writer, without a whole host copy of the array."""
import json
import subprocess
import sys
import textwrap

import numpy as np
import paddle
import pytest

import plsc.checkpoint.head_arrays as ckpt
from plsc.checkpoint.paddle_file import save_transient_bytes


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_streamed_npy_equals_numpy_save(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(ckpt, "_SLAB_BYTES", 100)  # many slabs, the last one partial
    rows = np.random.RandomState(0).normal(size=(203, 7)).astype(dtype)
    ckpt.save_rows_npy(str(tmp_path / "streamed.npy"), paddle.to_tensor(rows))
    np.save(str(tmp_path / "numpy.npy"), rows)
    assert (tmp_path / "streamed.npy").read_bytes() == (tmp_path / "numpy.npy").read_bytes()
    np.testing.assert_array_equal(np.load(str(tmp_path / "streamed.npy")), rows)


def test_unsupported_dtype_names_file_and_dtype(tmp_path):
    with pytest.raises(TypeError, match=r"weight\.npy.*bool"):
        ckpt.save_rows_npy(str(tmp_path / "weight.npy"), paddle.ones([3, 2], dtype="bool"))


_PROBE = textwrap.dedent("""
    import json, sys
    import numpy as np, paddle
    import plsc.checkpoint.head_arrays as ckpt
    ckpt._SLAB_BYTES = 16 << 20

    def peak():
        with open("/proc/self/status") as f:
            return 1024 * int(next(l for l in f if l.startswith("VmHWM")).split()[1])

    t = paddle.randn([{rows}, 256])
    t.numpy  # nothing copied yet
    before = peak()
    if sys.argv[1] == "stream":
        ckpt.save_rows_npy(sys.argv[2], t)
    else:
        np.save(sys.argv[2], t.numpy())
    print(json.dumps({{"before": before, "after": peak(), "bytes": int(t.size) * 4}}))
""")


def test_save_needs_no_whole_host_copy(tmp_path):
    """Peak RSS of a process saving a 256 MB head array: streamed, it grows by a slab; the
    whole-array copy it replaced grows by the array (so the measurement can tell them apart)."""
    script = tmp_path / "probe.py"
    script.write_text(_PROBE.format(rows=256 * 1024))
    grown = {}
    for how in ("stream", "copy"):
        out = subprocess.run([sys.executable, str(script), how, str(tmp_path / f"{how}.npy")],
                             capture_output=True, text=True, check=True).stdout
        m = json.loads(out.strip().splitlines()[-1])
        grown[how] = (m["after"] - m["before"]) / m["bytes"]
    assert grown["stream"] < 0.35, grown
    assert grown["copy"] > 0.9, grown


_PROBE_16 = textwrap.dedent("""
    import json, os, sys
    import numpy as np, paddle
    import plsc.checkpoint.head_arrays as ckpt
    ckpt._SLAB_BYTES = 4 << 20

    def peak(reset=False):
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # peak RSS := current RSS
        with open("/proc/self/status") as f:
            return 1024 * int(next(l for l in f if l.startswith("VmHWM")).split()[1])

    path = sys.argv[1]
    os.makedirs(os.path.join(path, "head_rank0"))
    t = paddle.full([{rows}, 256], 1.5, dtype="bfloat16")
    grown = {{}}
    before = peak()
    ckpt.save_rows_npy(os.path.join(path, "head_rank0", "weight.npy"), t)
    grown["save"] = peak() - before
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({{"num_classes": {rows}, "world_size": 1, "head_arrays": ["weight"],
                   "head_dtypes": {{"weight": "bfloat16"}}}}, f)
    before = peak(reset=True)
    ckpt.load_head_rows_into(path, "weight", 0, t)
    grown["load"] = peak() - before
    before = peak(reset=True)
    t.numpy()
    grown["copy"] = peak() - before
    print(json.dumps({{k: v / (int(t.size) * 2) for k, v in grown.items()}}))
""")


def test_bfloat16_save_and_load_need_no_whole_host_copy(tmp_path):
    """Peak RSS of a process saving a 64 MB bfloat16 head array and loading it back in place
    grows by a few slabs; a whole host copy (.numpy()) grows it by the array."""
    script = tmp_path / "probe16.py"
    script.write_text(_PROBE_16.format(rows=128 * 1024))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")],
                         capture_output=True, text=True, check=True).stdout
    grown = json.loads(out.strip().splitlines()[-1])
    assert grown["save"] < 0.35 and grown["load"] < 0.35, grown
    assert grown["copy"] > 0.9, grown


_PROBE_STATE = textwrap.dedent("""
    import io, json, sys
    import paddle
    from plsc.fileio import AtomicWriter
    from plsc.checkpoint.paddle_file import write_paddle_file

    def peak():
        with open("/proc/self/status") as f:
            return 1024 * int(next(l for l in f if l.startswith("VmHWM")).split()[1])

    paddle.seed(0)
    flat = {{f"w{{i}}": paddle.randn([{rows}, 256]) for i in range(32)}}
    nested = {{"opt": {{f"m{{i}}": paddle.randn([{rows}, 256]) for i in range(32)}}, "lr": {{"step": 3}}}}
    grown = {{}}
    for how in ("stream", "copy"):  # the streamed save first: a peak only grows
        before = peak()
        for state, name in ((flat, "flat"), (nested, "nested")):
            path = f"{{sys.argv[1]}}/{{how}}.{{name}}"
            if how == "stream":
                with AtomicWriter(path) as f:
                    write_paddle_file(f, state)
            else:  # the save it replaced: paddle.save into memory, then the bytes written
                buf = io.BytesIO()
                paddle.save(state, buf)
                with open(path, "wb") as f:
                    f.write(buf.getvalue())
                del buf
        grown[how] = (peak() - before) / (32 * {rows} * 256 * 4)
    print(json.dumps(grown))
""")


def test_paddle_state_save_streams(tmp_path):
    """A backbone's and an optimizer's state (a flat dict of tensors, a nested dict) written by
    `write_paddle_file`: `paddle.load` gives what it gives for `paddle.save`'s file, and the
    peak RSS of the save grows by a few tensors, where `paddle.save` into a BytesIO (the save
    it replaced) grows by more than twice the state (here about 3x); the planner's save term
    (`save_transient_bytes`) is what the streamed save grew by, within half."""
    script = tmp_path / "probe_state.py"
    script.write_text(_PROBE_STATE.format(rows=2048))  # 32 tensors of 2 MiB a state
    out = subprocess.run([sys.executable, str(script), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    grown = json.loads(out.strip().splitlines()[-1])
    assert grown["stream"] < 0.35, grown
    assert grown["copy"] > 2.0, grown
    # the planner's term for it: the copies of the largest tensor (here all are 2 MiB)
    term = save_transient_bytes(2048 * 256 * 4) / (32 * 2048 * 256 * 4)
    assert 0.5 * term <= grown["stream"] <= 1.5 * term, (grown, term)
    for name in ("flat", "nested"):
        mine, ref = (paddle.load(str(tmp_path / f"{how}.{name}")) for how in ("stream", "copy"))
        _same(mine, ref)


def _same(a, b, where="state"):
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, paddle.Tensor):
        assert (a.name, a.dtype, a.shape) == (b.name, b.dtype, b.shape), where
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    else:
        assert a == b, where
