"""Write the files of real torch that tests/test_torchfile.py reads (run once, in a Python
with torch and numpy; plsc is not needed):

    python tests/data/torchfile/make_fixtures.py

Every tensor's values come from `ramp` (np.arange-based, exact in its dtype), so the test
rebuilds them with numpy from the same construction; nothing here runs plsc. The script checks
each file with torch.load(weights_only=True) before keeping it, and the hand-made big-endian
copy against the original.
"""
import collections
import io
import os
import shutil
import sys
import tempfile
import warnings
import zipfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def ramp(shape, start=0.0, step=1.0, dtype=np.float32):
    """start + step·(0, 1, 2, ...) in C order, cast to `dtype` (the test's own copy of this)."""
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(n, dtype=np.float64) * step + start).reshape(shape).astype(dtype)


def t(array):
    return torch.from_numpy(np.array(array, order="C"))  # a 0-d array stays 0-d


def bf16(array):
    return t(np.asarray(array, np.float32)).to(torch.bfloat16)


def bf16_mantissas():
    """16 values using every bfloat16 mantissa bit pattern kind: ±(1 + k/128)·2^(k%7-3)."""
    k = np.arange(16)
    return ((1 + k / 128) * 2.0 ** (k % 7 - 3) * (-1.0) ** k).astype(np.float32)


class Backbone(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, bias=False)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(8, 5)


def backbone():
    """A module whose state_dict entry i (in order) is ramp(shape, i, 0.125), and whose
    bn.num_batches_tracked is 7."""
    model = Backbone()
    with torch.no_grad():
        for i, (name, value) in enumerate(model.state_dict().items()):
            if name.endswith("num_batches_tracked"):
                value.fill_(7)
            else:
                value.copy_(t(ramp(tuple(value.shape), i, 0.125)))
    return model


class PartialFC(torch.nn.Module):
    """arcface_torch's PartialFC_V2 keeps its centres as one Parameter `weight`."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(t(ramp((6, 5), -1.0, 1 / 32)))


class PolyScheduler(torch.optim.lr_scheduler.LRScheduler):
    """arcface_torch's PolyScheduler (lr_scheduler.py), for its state_dict's shape."""

    def __init__(self, optimizer, base_lr, max_steps, warmup_steps, last_epoch=-1):
        self.base_lr = base_lr
        self.warmup_lr_init = 0.0001
        self.max_steps = max_steps
        self.warmup_steps = warmup_steps
        self.power = 2
        super().__init__(optimizer, -1)

    def get_warmup_lr(self):
        alpha = float(self.last_epoch) / float(self.warmup_steps)
        return [self.base_lr * alpha for _ in self.optimizer.param_groups]

    def get_lr(self):
        if self.last_epoch == -1:
            return [self.warmup_lr_init for _ in self.optimizer.param_groups]
        if self.last_epoch < self.warmup_steps:
            return self.get_warmup_lr()
        alpha = pow(1 - float(self.last_epoch - self.warmup_steps)
                    / float(self.max_steps - self.warmup_steps), self.power)
        return [self.base_lr * alpha for _ in self.optimizer.param_groups]


def checkpoint():
    """arcface_torch's training checkpoint (train_v2.py): epoch, global_step, both state
    dicts, SGD's state_dict with a momentum buffer ramp(shape, -i, 1/64) for parameter i, and
    the PolyScheduler's state_dict after 5 steps."""
    model, pfc = backbone(), PartialFC()
    opt = torch.optim.SGD(params=[{"params": model.parameters()}, {"params": pfc.parameters()}],
                          lr=0.1, momentum=0.9, weight_decay=5e-4)
    params = list(model.parameters()) + list(pfc.parameters())
    for i, p in enumerate(params):
        opt.state[p]["momentum_buffer"] = t(ramp(tuple(p.shape), -i, 1 / 64))
    scheduler = PolyScheduler(opt, base_lr=0.1, max_steps=100, warmup_steps=10)
    for _ in range(5):
        opt.step()  # no gradients: the parameters and buffers stay as set
        scheduler.step()
    for i, p in enumerate(params):  # they did stay
        assert np.array_equal(opt.state[p]["momentum_buffer"].numpy(),
                              ramp(tuple(p.shape), -i, 1 / 64))
    return {"epoch": 3, "global_step": 1234, "state_dict_backbone": model.state_dict(),
            "state_dict_softmax_fc": pfc.state_dict(), "state_optimizer": opt.state_dict(),
            "state_lr_scheduler": scheduler.state_dict()}


def views():
    """Tensors that are views: offsets, non-contiguous and zero strides, and storages shared
    by several tensors (4 storages for 12 tensors; base and flat both cover theirs whole)."""
    base = t(ramp((4, 6)))
    whole = t(ramp((10,), 100.0))  # not saved itself: two tensors view halves of it
    longs = t(ramp((3, 4), dtype=np.int64))
    return {"base": base, "flat": base.view(24), "transposed": base.t(), "slice": base[1:3, 2:5],
            "strided": base[::2, 1::3], "row": base[2], "column": base[:, 3],
            "element": base[3, 5], "half_a": whole[:5], "half_b": whole[5:],
            "expanded": t(ramp((3,), -1.0)).expand(4, 3), "long_t": longs.t()[1:]}


def dtypes():
    f16 = t(ramp((2, 3), -1.0, 0.5, np.float16))
    plain = torch.ones(2)
    plain.note = "an attribute"  # pickled through torch._tensor._rebuild_from_type_v2
    return {
        "f32": t(ramp((2, 3), 0.5)), "f64": t(ramp((3,), -0.25, 0.5, np.float64)),
        "f16": f16, "f16_t": f16.t(),
        "bf16": bf16(ramp((3, 4), -2.0, 0.25)), "bf16_mantissas": bf16(bf16_mantissas()),
        "bf16_view": bf16(ramp((4, 5), 1.0, 0.5))[1:, ::2].t(),
        "i64": t(ramp((2, 2), -2, 1, np.int64)), "i32": t(ramp((3,), -1, 1000, np.int32)),
        "i16": t(ramp((3,), -300, 300, np.int16)), "i8": t(ramp((4,), -2, 1, np.int8)),
        "u8": t(ramp((4,), 250, 1, np.uint8)), "u16": t(ramp((3,), 65533, 1, np.uint16)),
        "bool": t(ramp((5,), dtype=np.int64) % 3 == 0),
        "c64": t(ramp((2,), 1.0) + 1j * ramp((2,), -1.0)).to(torch.complex64),
        "param": torch.nn.Parameter(t(ramp((2, 2), 3.0))), "attribute": plain,
        "neg": torch._neg_view(t(ramp((3,), 1.0))), "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5), "int_scalar": torch.tensor(-7),
        "plain": {"int": 5, "float": 0.1, "str": "s", "none": None, "true": True,
                  "list": [1, 2.5, "x"], "tuple": (1, (2, 3)), "big": 2 ** 70, "bytes": b"ab",
                  "set": {1, 2}, "dtype": torch.float16, "device": torch.device("cpu"),
                  "size": torch.Size([2, 3])},
    }


def small():
    return collections.OrderedDict(weight=t(ramp((2, 3), 1.0)), steps=t(np.array(9, np.int64)))


def rewrite(src, dst, change):
    """Copy the zip archive `src` to `dst` record by record (stored, zipfile's layout: no
    64-byte alignment), each record's data through `change(name, data)` (name without the
    folder; None drops the record)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = change(info.filename.split("/", 1)[1], zin.read(info))
            if data is not None:
                zout.writestr(info.filename, data)


def big_endian(itemsizes):
    """A `change` making what a big-endian machine writes: every storage byte-swapped and the
    byteorder record "big"; `itemsizes[key]` is storage key's element size."""
    def change(name, data):
        if name == "byteorder":
            return b"big"
        if name.startswith("data/"):
            size = itemsizes[name[5:]]
            return np.frombuffer(data, f"<u{size}").astype(f">u{size}").tobytes()
        return data
    return change


def check_same(a, b):
    if isinstance(a, torch.UntypedStorage):
        assert a.tolist() == b.tolist()  # torch.load gives a (uint8) TypedStorage back
    elif a is not None and torch.is_tensor(a) and a.dtype == torch.float8_e4m3fn:
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            check_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            check_same(x, y)
    else:
        assert a == b, (a, b)


def main(out=HERE):
    tmp = tempfile.mkdtemp()
    try:
        def put(name, obj, **kwargs):
            path = os.path.join(out, name)
            torch.save(obj, path, **kwargs)
            if kwargs.get("_use_new_zipfile_serialization", True):
                check_same(obj, torch.load(path, weights_only=True))
            return path

        put("state_dict.pt", backbone().state_dict())
        put("views.pt", views())
        put("dtypes.pt", dtypes())
        put("checkpoint.pt", checkpoint())
        # torch 2.14 writes a byteorder record even with _disable_byteorder_record=True (its
        # C++ writer adds one); older torch wrote none: drop it from a copy
        original = os.path.join(tmp, "no_byteorder.pt")
        torch.save(small(), original)
        path = os.path.join(out, "no_byteorder.pt")
        rewrite(original, path, lambda name, data: None if name == "byteorder" else data)
        check_same(small(), torch.load(path, weights_only=True))
        put("legacy.pt", small(), _use_new_zipfile_serialization=False)
        with warnings.catch_warnings():  # torch.load of a storage: "TypedStorage is deprecated"
            warnings.simplefilter("ignore", UserWarning)
            put("bare_storage.pt", {"s": t(ramp((3,))).untyped_storage()})  # refused by plsc
        put("float8.pt", {"f8": t(ramp((4,))).to(torch.float8_e4m3fn)})  # refused by plsc
        # a file saved as original_name.pt, then renamed: its folder stays original_name/
        original = os.path.join(tmp, "original_name.pt")
        torch.save(small(), original)
        shutil.move(original, os.path.join(out, "renamed.pt"))
        # saved to a buffer: folder archive/
        buffer = io.BytesIO()
        torch.save(small(), buffer)
        with open(os.path.join(out, "archive_prefix.pt"), "wb") as f:
            f.write(buffer.getvalue())
        # big-endian: storages 0..3 are f32, i64, f16, bf16 (keys in pickling order)
        obj = {"f32": t(ramp((2, 3), -1.0, 0.375)), "i64": t(ramp((3,), -2 ** 40, 2 ** 33,
                                                                   np.int64)),
               "f16": t(ramp((2, 2), 0.5, -0.25, np.float16)), "bf16": bf16(bf16_mantissas())}
        little = os.path.join(tmp, "big_endian.pt")
        torch.save(obj, little)
        path = os.path.join(out, "big_endian.pt")
        rewrite(little, path, big_endian({"0": 4, "1": 8, "2": 2, "3": 2}))
        check_same(obj, torch.load(path, weights_only=True))  # torch swaps them back
    finally:
        shutil.rmtree(tmp)
    for name in sorted(os.listdir(out)):
        print(f"{os.path.getsize(os.path.join(out, name)):7d}  {name}")
    print(f"torch {torch.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
