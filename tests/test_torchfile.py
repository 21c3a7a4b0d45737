"""plsc.torchfile: PyTorch's zip file format read and written without torch.

Reading is checked on files real torch wrote (tests/data/torchfile/*.pt, made once by
make_fixtures.py there): every tensor's expected value is rebuilt here with numpy from the
fixture script's construction (`ramp`, np.arange-based, exact in its dtype), never read back
from plsc. Writing is checked with an independent decoder of the pickle (Python's own
unpickler with stubs for torch's names) and zip reader (`zipfile`, struct), and, where torch is
installed, by torch.load itself (skipped in CI, which has no torch).
"""
import collections
import io
import os
import pickle
import struct
import zipfile

import numpy as np
import pytest

from plsc import torchfile
from plsc.torchfile import TorchFileError

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "torchfile")


def fixture(name):
    return os.path.join(DATA, name)


def ramp(shape, start=0.0, step=1.0, dtype=np.float32):
    """make_fixtures.py's construction: start + step·(0, 1, 2, ...) in C order, cast."""
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(n, dtype=np.float64) * step + start).reshape(shape).astype(dtype)


def bf16_mantissas():
    k = np.arange(16)
    return ((1 + k / 128) * 2.0 ** (k % 7 - 3) * (-1.0) ** k).astype(np.float32)


def assert_array(actual, expected):
    """Same dtype, shape and values (bit for bit: every value here is exact in its dtype),
    C-contiguous and writeable."""
    assert isinstance(actual, np.ndarray), type(actual)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.array_equal(actual, expected, equal_nan=actual.dtype.kind in "fc"), (actual,
                                                                                   expected)
    assert actual.flags.c_contiguous and actual.flags.writeable


def assert_one_line_error(err, path):
    text = str(err.value)
    assert path in text and "\n" not in text, text
    return text


def zip_folder(path):
    with zipfile.ZipFile(path) as zf:
        return {name.split("/", 1)[0] for name in zf.namelist()}


def storage_records(path):
    with zipfile.ZipFile(path) as zf:
        return sorted(n for n in zf.namelist() if "/data/" in n)


# ---------------------------------------------------------------------------------------------
# Files written by torch

# make_fixtures.py's Backbone: Conv2d(3, 4, 3, bias=False), BatchNorm2d(4), Linear(8, 5)
BACKBONE = [("conv.weight", (4, 3, 3, 3)), ("bn.weight", (4,)), ("bn.bias", (4,)),
            ("bn.running_mean", (4,)), ("bn.running_var", (4,)), ("bn.num_batches_tracked", ()),
            ("fc.weight", (5, 8)), ("fc.bias", (5,))]


def check_backbone(sd):
    assert isinstance(sd, collections.OrderedDict)
    assert [k for k, _ in BACKBONE] == list(sd)
    for i, (name, shape) in enumerate(BACKBONE):
        if name == "bn.num_batches_tracked":
            assert_array(sd[name], np.array(7, np.int64))
        else:
            assert_array(sd[name], ramp(shape, i, 0.125))


def test_state_dict_from_torch():
    check_backbone(torchfile.load(fixture("state_dict.pt")))


def test_views_offsets_strides_and_shared_storages():
    path = fixture("views.pt")
    # the fixture's 12 tensors view 4 storages: base, whole, the expanded ramp and longs
    assert len(storage_records(path)) == 4
    got = torchfile.load(path)
    base, whole, longs = ramp((4, 6)), ramp((10,), 100.0), ramp((3, 4), dtype=np.int64)
    expected = {"base": base, "flat": base.reshape(24), "transposed": base.T,
                "slice": base[1:3, 2:5], "strided": base[::2, 1::3], "row": base[2],
                "column": base[:, 3], "element": base[3, 5], "half_a": whole[:5],
                "half_b": whole[5:], "expanded": np.broadcast_to(ramp((3,), -1.0), (4, 3)),
                "long_t": longs.T[1:]}
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert_array(got[name], np.array(value, order="C"))
    # each array owns its values: writing one changes no other
    names = list(got)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not np.shares_memory(got[a], got[b]), (a, b)


def test_dtypes_from_torch():
    got = torchfile.load(fixture("dtypes.pt"))
    f16 = ramp((2, 3), -1.0, 0.5, np.float16)
    bool_ = ramp((5,), dtype=np.int64) % 3 == 0
    expected = {
        "f32": ramp((2, 3), 0.5), "f64": ramp((3,), -0.25, 0.5, np.float64), "f16": f16,
        "f16_t": f16.T,
        # bfloat16 comes back as float32 of the same values (all exact in bfloat16)
        "bf16": ramp((3, 4), -2.0, 0.25), "bf16_mantissas": bf16_mantissas(),
        "bf16_view": ramp((4, 5), 1.0, 0.5)[1:, ::2].T,
        "i64": ramp((2, 2), -2, 1, np.int64), "i32": np.array([-1, 999, 1999], np.int32),
        "i16": np.array([-300, 0, 300], np.int16), "i8": np.array([-2, -1, 0, 1], np.int8),
        "u8": np.array([250, 251, 252, 253], np.uint8),
        "u16": np.array([65533, 65534, 65535], np.uint16), "bool": bool_,
        "c64": np.array([1 - 1j, 2 + 0j], np.complex64), "param": ramp((2, 2), 3.0),
        "attribute": np.ones(2, np.float32), "neg": -ramp((3,), 1.0),
        "empty": np.zeros((0, 4), np.float32), "scalar": np.array(3.5, np.float32),
        "int_scalar": np.array(-7, np.int64),
    }
    for name, value in expected.items():
        assert_array(got[name], np.array(value, order="C"))
    # the bfloat16 values as bits: float32 bits are the bfloat16 bits << 16, low half zero
    assert not np.any(got["bf16_mantissas"].view(np.uint32) & 0xFFFF)
    plain = got["plain"]
    assert plain == {"int": 5, "float": 0.1, "str": "s", "none": None, "true": True,
                     "list": [1, 2.5, "x"], "tuple": (1, (2, 3)), "big": 2 ** 70,
                     "bytes": b"ab", "set": {1, 2}, "dtype": "torch.float16", "device": "cpu",
                     "size": (2, 3)}
    assert isinstance(plain["dtype"], torchfile.TorchDtype)
    assert plain["dtype"].numpy == np.float16


def test_arcface_torch_checkpoint():
    ck = torchfile.load(fixture("checkpoint.pt"))
    assert list(ck) == ["epoch", "global_step", "state_dict_backbone", "state_dict_softmax_fc",
                        "state_optimizer", "state_lr_scheduler"]
    assert ck["epoch"] == 3 and ck["global_step"] == 1234
    check_backbone(ck["state_dict_backbone"])
    assert list(ck["state_dict_softmax_fc"]) == ["weight"]
    assert_array(ck["state_dict_softmax_fc"]["weight"], ramp((6, 5), -1.0, 1 / 32))
    # SGD's state: parameters numbered over both groups (the backbone's 5, then the centres)
    params = [shape for name, shape in BACKBONE if "running" not in name and "num_" not in name]
    params.append((6, 5))
    opt = ck["state_optimizer"]
    assert list(opt["state"]) == list(range(6))
    for i, shape in enumerate(params):
        assert list(opt["state"][i]) == ["momentum_buffer"]
        assert_array(opt["state"][i]["momentum_buffer"], ramp(shape, -i, 1 / 64))
    assert [g["params"] for g in opt["param_groups"]] == [[0, 1, 2, 3, 4], [5]]
    for group in opt["param_groups"]:
        assert (group["momentum"], group["weight_decay"], group["initial_lr"]) == (0.9, 5e-4, 0.1)
        # arcface_torch's PolyScheduler in warm-up: base_lr · step / warmup_steps
        assert group["lr"] == 0.1 * 5 / 10
        assert group["nesterov"] is False and group["foreach"] is None
    sched = ck["state_lr_scheduler"]
    assert (sched["last_epoch"], sched["base_lrs"], sched["max_steps"],
            sched["warmup_steps"]) == (5, [0.1, 0.1], 100, 10)


def small_expected():
    return {"weight": ramp((2, 3), 1.0), "steps": np.array(9, np.int64)}


@pytest.mark.parametrize("name, folder", [("renamed.pt", "original_name"),
                                          ("archive_prefix.pt", "archive")])
def test_zip_folder_name_not_assumed(name, folder):
    path = fixture(name)
    assert zip_folder(path) == {folder}  # not the file's stem
    got = torchfile.load(path)
    assert list(got) == ["weight", "steps"]
    for key, value in small_expected().items():
        assert_array(got[key], value)


def test_file_without_byteorder_record_is_little_endian():
    path = fixture("no_byteorder.pt")
    with zipfile.ZipFile(path) as zf:
        assert not [n for n in zf.namelist() if n.endswith("/byteorder")]
    got = torchfile.load(path)
    for key, value in small_expected().items():
        assert_array(got[key], value)


def test_big_endian_file():
    got = torchfile.load(fixture("big_endian.pt"))
    expected = {"f32": ramp((2, 3), -1.0, 0.375), "i64": ramp((3,), -2 ** 40, 2 ** 33, np.int64),
                "f16": ramp((2, 2), 0.5, -0.25, np.float16), "bf16": bf16_mantissas()}
    for key, value in expected.items():
        assert_array(got[key], value)


# ---------------------------------------------------------------------------------------------
# Files refused


def test_legacy_file_refused():
    path = fixture("legacy.pt")
    with pytest.raises(TorchFileError) as err:
        torchfile.load(path)
    text = assert_one_line_error(err, path)
    assert "torch < 1.6 with the legacy format" in text and "re-save it with torch >= 1.6" in text


def flipped_storage_byte(src, dst):
    """Copy `src` with one byte of its first storage record's data inverted."""
    raw = bytearray(open(src, "rb").read())
    with zipfile.ZipFile(src) as zf:
        info = zf.getinfo(storage_records(src)[0])
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    raw[info.header_offset + 30 + name_len + extra_len + 1] ^= 0xFF
    with open(dst, "wb") as f:
        f.write(raw)


def make_zip(path, records):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in records.items():
            zf.writestr(name, data)
    return str(path)


def tensor_pickle(offset, size, stride, numel, storage="torch\nFloatStorage"):
    """A data.pkl holding one float tensor, written opcode by opcode: _rebuild_tensor_v2 of
    storage '0' with `numel` elements at `offset`, `size`, `stride` (1-d, small ints)."""
    def ustr(s):
        return b"X" + struct.pack("<I", len(s)) + s.encode()
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((" + ustr("storage") + b"c"
            + storage.encode() + b"\n" + ustr("0") + ustr("cpu") + b"K" + bytes([numel])
            + b"tQK" + bytes([offset]) + b"K" + bytes([size]) + b"\x85K" + bytes([stride])
            + b"\x85\x89ccollections\nOrderedDict\n)RtR.")


def test_damaged_files_refused(tmp_path):
    src = fixture("state_dict.pt")
    raw = open(src, "rb").read()
    cases = {}
    cases["cut.pt"] = raw[:len(raw) // 2]
    cases["tail_cut.pt"] = raw[:-30]
    for name, data in cases.items():
        with open(tmp_path / name, "wb") as f:
            f.write(data)
    flipped_storage_byte(src, tmp_path / "flipped.pt")
    with zipfile.ZipFile(src) as zf:
        records = {n: zf.read(n) for n in zf.namelist()}
    first = storage_records(src)[0]
    short = dict(records, **{first: records[first][:-4]})
    make_zip(tmp_path / "short_record.pt", short)
    missing = {n: d for n, d in records.items() if n != first}
    make_zip(tmp_path / "missing_record.pt", missing)
    reasons = {"cut.pt": "damaged PyTorch zip file", "tail_cut.pt": "damaged PyTorch zip file",
               "flipped.pt": "CRC",
               "short_record.pt": f"holds {4 * 3 * 3 * 3 * 4 - 4} bytes",  # conv.weight, less 4
               "missing_record.pt": "no record"}
    for name, reason in reasons.items():
        path = str(tmp_path / name)
        with pytest.raises(TorchFileError) as err:
            torchfile.load(path)
        assert reason in assert_one_line_error(err, path), (name, str(err.value))


def test_files_not_of_tensors_refused(tmp_path):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    text = tmp_path / "text.pt"
    text.write_bytes(b"hello, not a checkpoint\n")
    script = make_zip(tmp_path / "script.pt", {"m/data.pkl": b"\x80\x02N.",
                                                 "m/constants.pkl": b"\x80\x02).",
                                                 "m/version": b"3\n"})
    nopkl = make_zip(tmp_path / "nopkl.pt", {"a/version": b"3\n"})
    for path, reason in ((empty, "empty file"), (text, "not a PyTorch file"),
                         (script, "TorchScript"), (nopkl, "without data.pkl"),
                         (fixture("bare_storage.pt"), "storage saved bare"),
                         (fixture("float8.pt"), "torch.float8_e4m3fn, which numpy has no")):
        with pytest.raises(TorchFileError) as err:
            torchfile.load(path)
        assert reason in assert_one_line_error(err, str(path))


def test_unknown_globals_refused_before_any_call(tmp_path):
    marker = tmp_path / "ran"
    command = f"touch {marker}"
    hostile = {
        "posix.system": b"\x80\x02cposix\nsystem\nX" + struct.pack("<I", len(command))
                        + command.encode() + b"\x85R.",
        "builtins.eval": b"\x80\x02cbuiltins\neval\nX\x03\x00\x00\x001+1\x85R.",
        "torch.nn.modules.linear.Linear": b"\x80\x02ctorch.nn.modules.linear\nLinear\n)R.",
        "torch._utils._rebuild_qtensor": b"\x80\x02ctorch._utils\n_rebuild_qtensor\n)R.",
    }
    for name, pkl in hostile.items():
        path = make_zip(tmp_path / "hostile.pt", {"x/data.pkl": pkl, "x/version": b"3\n"})
        with pytest.raises(TorchFileError) as err:
            torchfile.load(path)
        assert f"'{name}'" in assert_one_line_error(err, path)
    assert not marker.exists()


def test_views_outside_their_storage_refused(tmp_path):
    data = ramp((4,)).tobytes()
    ok = make_zip(tmp_path / "ok.pt", {"x/data.pkl": tensor_pickle(1, 3, 1, 4),
                                       "x/data/0": data})
    assert_array(torchfile.load(ok), ramp((4,))[1:])  # the last element is inside
    for offset, size, stride in ((2, 3, 1), (0, 3, 2), (4, 1, 1)):
        path = make_zip(tmp_path / "bad.pt", {"x/data.pkl": tensor_pickle(offset, size, stride, 4),
                                              "x/data/0": data})
        with pytest.raises(TorchFileError) as err:
            torchfile.load(path)
        assert "outside its storage" in assert_one_line_error(err, path)


# ---------------------------------------------------------------------------------------------
# Writing


def sample_object():
    """Nested containers of arrays of several dtypes and shapes, and plain values."""
    rng = np.random.default_rng(24)
    big = rng.standard_normal((257, 1031)).astype(np.float32)  # about 1 MB
    shared = ramp((3,), 5, 1, np.int64)
    return collections.OrderedDict([
        ("weights", collections.OrderedDict([
            ("conv", ramp((4, 3, 3, 3), -1.0, 0.01)), ("big", big),
            ("transposed_input", ramp((3, 5), 0.5).T),  # saved in C order
            ("half", ramp((2, 3), -0.75, 0.25, np.float16)),
            ("half_special", np.array([np.inf, -np.inf, np.nan, -0.0, 6.1e-5, 65504],
                                      np.float16)),
            ("steps", np.array(12, np.int64)), ("scalar", np.array(-2.5, np.float32)),
            ("empty", np.zeros((0, 3), np.float32)), ("empty3", np.zeros((2, 0, 3), np.int64)),
            ("mask", ramp((7,), dtype=np.int64) % 2 == 0),
            ("big_endian_input", ramp((3,), -2 ** 40, 2 ** 35, np.int64).astype(">i8")),
            ("f64", np.array([np.pi, -1e300, 5e-324])), ("i32", np.array([-2 ** 31, 7], np.int32)),
            ("u8", np.array([0, 255], np.uint8)), ("i8", np.array([-128, 127], np.int8)),
            ("u16", np.array([0, 65535], np.uint16)),
        ])),
        ("optimizer", {"state": {np.int64(0): {"momentum_buffer": ramp((2, 2), 0.125)},
                                 1: {"momentum_buffer": shared}, 2: {"also": shared}},
                       "param_groups": [{"lr": 0.1, "momentum": 0.9, "nesterov": False,
                                         "foreach": None, "params": [0, 1, 2],
                                         "betas": (0.9, 0.999)}]}),
        ("epoch", 3), ("global_step", 2 ** 40), ("negative", -70000), ("huge", -2 ** 100),
        ("nan", float("nan")), ("name", "r50 ✓ é"), ("flags", [True, False, None]),
        ("tuple", (1, (2, "three", 4.0, [5]))), ("numpy_scalars", [np.int64(7), np.float32(0.5),
                                                                    np.bool_(True)]),
        ("many", list(range(2500))), ("many_keys", {i: str(i) for i in range(1200)}),
    ])


def assert_same(actual, expected, where="obj"):
    if isinstance(expected, np.ndarray):
        assert_array(actual, np.array(expected, dtype=expected.dtype.newbyteorder("="),
                                      order="C"))
    elif isinstance(expected, dict):
        assert type(actual) is type(expected), (where, type(actual))
        assert list(actual) == list(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, np.generic):
        assert type(actual) is type(expected.item()) and actual == expected.item(), where
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, where
    else:
        assert type(actual) is type(expected) and actual == expected, (where, actual)


def test_round_trip(tmp_path):
    obj = sample_object()
    path = tmp_path / "round.pt"
    record = torchfile.save(obj, path)
    assert record.size == os.path.getsize(path)
    assert os.listdir(tmp_path) == ["round.pt"]  # the atomic writer left no temporary file
    got = torchfile.load(path)
    assert_same(got, obj)
    # the array saved twice (one storage) comes back as two arrays that share no memory
    shared = got["optimizer"]["state"][1]["momentum_buffer"]
    assert not np.shares_memory(shared, got["optimizer"]["state"][2]["also"])


class _StubUnpickler(pickle.Unpickler):
    """Decodes data.pkl the way torch.load resolves it, with stubs for torch's names."""

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return lambda *args: (name,) + args
        if module in ("torch", "torch.storage"):
            return f"{module}.{name}"
        raise AssertionError(f"unexpected global {module}.{name}")

    def persistent_load(self, pid):
        return pid


def test_written_file_is_torch_format(tmp_path):
    a = ramp((2, 3), 0.25)
    obj = {"a": a, "h": ramp((4,), 1.0, 0.5, np.float16), "l": ramp((2, 2), -3, 1, np.int64),
           "b": np.array([True, False, True]), "s": np.array(2.0, np.float32), "again": a,
           "u": np.array([1, 2], np.uint16), "e": np.zeros((0, 2), np.float32)}
    path = tmp_path / "my_weights.pt"
    torchfile.save(obj, path)
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        names = [i.filename for i in infos]
        assert names == ["my_weights/data.pkl", "my_weights/byteorder"] + \
            [f"my_weights/data/{k}" for k in range(7)] + ["my_weights/version"]
        assert zf.testzip() is None
        assert zf.read("my_weights/byteorder") == b"little"
        assert zf.read("my_weights/version") == b"3\n"
        for info in infos:
            assert info.compress_type == zipfile.ZIP_STORED
            name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:
                                                          info.header_offset + 30])
            assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0, info.filename
        pkl = zf.read("my_weights/data.pkl")
        stored = {k: zf.read(f"my_weights/data/{k}") for k in range(7)}
    assert pkl[:2] == b"\x80\x02"  # protocol 2
    got = _StubUnpickler(io.BytesIO(pkl)).load()
    assert list(got) == list(obj)
    expected = {  # storage class, element count, storage key: one storage per array object
        "a": ("torch.FloatStorage", 6, "0"), "h": ("torch.HalfStorage", 4, "1"),
        "l": ("torch.LongStorage", 4, "2"), "b": ("torch.BoolStorage", 3, "3"),
        "s": ("torch.FloatStorage", 1, "4"), "again": ("torch.FloatStorage", 6, "0"),
        "u": ("torch.storage.UntypedStorage", 4, "5"), "e": ("torch.FloatStorage", 0, "6")}
    strides = {"a": (3, 1), "h": (1,), "l": (2, 1), "b": (1,), "s": (), "again": (3, 1),
               "u": (1,), "e": (2, 1)}
    for name, (storage_type, numel, key) in expected.items():
        call = got[name]
        func = "_rebuild_tensor_v3" if name == "u" else "_rebuild_tensor_v2"
        assert call[0] == func
        assert call[1] == ("storage", storage_type, key, "cpu", numel), (name, call[1])
        assert call[2:7] == (0, obj[name].shape, strides[name], False, collections.OrderedDict())
        if name == "u":
            assert call[7] == "torch.uint16"
        else:
            assert len(call) == 7
        little = obj[name].astype(obj[name].dtype.newbyteorder("<"))
        assert stored[int(key)] == little.tobytes(), name


def test_zip64_fields(tmp_path, monkeypatch):
    monkeypatch.setattr(torchfile.writer, "_ZIP64_LIMIT", 100)  # zip64 from 100 bytes
    obj = {"a": ramp((50,), -1.0, 0.5), "b": ramp((3,), dtype=np.int64)}
    path = tmp_path / "z64.pt"
    torchfile.save(obj, path)
    raw = path.read_bytes()
    assert b"PK\x06\x06" in raw and b"PK\x06\x07" in raw  # zip64 end records
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        info = zf.getinfo("z64/data/0")
        assert info.file_size == 200 and info.extra[:2] == b"\x01\x00"  # sizes in zip64 fields
        assert zf.read("z64/data/1") == obj["b"].astype("<i8").tobytes()
        assert zf.getinfo("z64/data/1").header_offset > 100  # its offset in a zip64 field
    assert_same(torchfile.load(path), obj)


@pytest.mark.parametrize("bad", [np.array([object()]), np.zeros(2, "M8[s]"), np.array(["a"]),
                                 {"k": {1, 2}}, {(1, 2): 3}, object()])
def test_save_refuses_what_torch_load_cannot_read(tmp_path, bad):
    path = tmp_path / "bad.pt"
    with pytest.raises(TorchFileError):
        torchfile.save({"x": bad}, path)
    assert os.listdir(tmp_path) == []


def test_save_refuses_a_cycle(tmp_path):
    cycle = {"a": []}
    cycle["a"].append(cycle)
    with pytest.raises(TorchFileError, match="cycle"):
        torchfile.save(cycle, tmp_path / "c.pt")


def test_torch_reads_what_save_writes(tmp_path):
    torch = pytest.importorskip("torch")  # not in plsc's environments: run where torch is
    obj = sample_object()
    path = tmp_path / "for_torch.pt"
    torchfile.save(obj, path)

    def check(actual, expected):
        if isinstance(expected, np.ndarray):
            assert torch.is_tensor(actual) and actual.is_contiguous()
            expected = np.array(expected, dtype=expected.dtype.newbyteorder("="), order="C")
            assert actual.numpy().dtype == expected.dtype
            assert np.array_equal(actual.numpy(), expected, equal_nan=expected.dtype.kind == "f")
        elif isinstance(expected, dict):
            assert type(actual) is type(expected) and list(actual) == list(expected)
            for key in expected:
                check(actual[key], expected[key])
        elif isinstance(expected, (list, tuple)):
            assert type(actual) is type(expected) and len(actual) == len(expected)
            for a, e in zip(actual, expected):
                check(a, e)
        elif isinstance(expected, np.generic):
            assert actual == expected.item()
        elif not (isinstance(expected, float) and expected != expected):
            assert actual == expected
    for mmap in (False, True):
        check(torch.load(path, weights_only=True, mmap=mmap), obj)
