"""Pickle protocol 2 as torch writes it, by hand (Python's pickler would need the torch
classes): plain values, dicts, lists, tuples and numpy arrays as tensors."""
import collections
import struct

import numpy as np

from .elements import _SAVE_TYPES, _SAVE_V3, TorchFileError

_BATCH = 1000  # items per SETITEMS/APPENDS, as Python's pickler batches


class _Pickler:
    """Pickle protocol 2 as torch writes it, for plain values and numpy arrays; `storages`
    collects the arrays (C order, little-endian) in key order."""

    def __init__(self):
        self.out = bytearray()
        self.memo = {}
        self.storages = []  # the arrays, storage key = index
        self.keys = {}  # id(array given) -> storage key
        self.keep = []  # the arrays given, so that their ids stay theirs
        self.active = set()  # ids of the containers being written (a cycle is refused)

    def dump(self, obj):
        self.out += b"\x80\x02"
        self.save(obj, "the object")
        self.out += b"."
        return bytes(self.out)

    def put(self, key):
        index = self.memo[key] = len(self.memo)
        self.out += b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)

    def get(self, key):
        index = self.memo[key]
        self.out += b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)

    def global_(self, module, name):
        key = ("global", module, name)
        if key in self.memo:
            self.get(key)
        else:
            self.out += f"c{module}\n{name}\n".encode("ascii")
            self.put(key)

    def int_(self, x):
        if 0 <= x < 256:
            self.out += b"K" + bytes([x])
        elif 0 <= x < 65536:
            self.out += b"M" + struct.pack("<H", x)
        elif -2 ** 31 <= x < 2 ** 31:
            self.out += b"J" + struct.pack("<i", x)
        else:
            data = x.to_bytes((x.bit_length() + 8) // 8, "little", signed=True)
            if len(data) > 255:
                raise TorchFileError(f"integer {x} is too large for torch.load "
                                     "(its pickle reader takes up to 255 bytes)")
            self.out += b"\x8a" + bytes([len(data)]) + data

    def str_(self, s):
        data = s.encode("utf-8", "surrogatepass")
        self.out += b"X" + struct.pack("<I", len(data)) + data

    def tuple_(self, items, where):
        if not items:
            self.out += b")"
            return
        if len(items) > 3:
            self.out += b"("
        for item in items:
            self.save(item, where)
        self.out += b"t" if len(items) > 3 else b"\x85\x86\x87"[len(items) - 1:len(items)]

    def save(self, obj, where):
        if obj is None:
            self.out += b"N"
        elif obj is True or obj is False:
            self.out += b"\x88" if obj else b"\x89"
        elif isinstance(obj, int):
            self.int_(int(obj))
        elif isinstance(obj, float):
            self.out += b"G" + struct.pack(">d", obj)
        elif isinstance(obj, str):
            self.str_(str(obj))
        elif isinstance(obj, np.ndarray):
            self.tensor(obj, where)
        elif isinstance(obj, (np.bool_, np.integer, np.floating)):
            self.save(obj.item(), where)
        elif isinstance(obj, (dict, list, tuple)):
            if id(obj) in self.active:
                raise TorchFileError(f"{where} contains itself; cannot save a cycle")
            self.active.add(id(obj))
            if isinstance(obj, dict):
                self.dict_(obj, where)
            elif isinstance(obj, list):
                self.out += b"]"
                items = list(obj)
                for i in range(0, len(items), _BATCH):
                    self.out += b"("
                    for j, item in enumerate(items[i:i + _BATCH], i):
                        self.save(item, f"{where}[{j}]")
                    self.out += b"e"
            else:
                self.tuple_(tuple(obj), f"{where}[...]")
            self.active.discard(id(obj))
        else:
            raise TorchFileError(f"cannot save {where}: a {type(obj).__name__} (numpy arrays, "
                                 "dicts, lists, tuples, str, int, float, bool and None only)")

    def dict_(self, obj, where):
        if isinstance(obj, collections.OrderedDict):
            self.global_("collections", "OrderedDict")
            self.out += b")R"
        else:
            self.out += b"}"
        items = list(obj.items())
        for i in range(0, len(items), _BATCH):
            self.out += b"("
            for key, value in items[i:i + _BATCH]:
                if isinstance(key, (np.bool_, np.integer, np.floating, np.str_)):
                    key = key.item()
                if not (key is None or isinstance(key, (str, int, float))):
                    raise TorchFileError(f"cannot save {where}: a key of type "
                                         f"{type(key).__name__} (str, int, float, bool, None)")
                self.save(key, where)
                self.save(value, f"{where}[{key!r}]")
            self.out += b"u"

    def tensor(self, arr, where):
        dtype = arr.dtype.newbyteorder("=") if arr.dtype.byteorder in ("<", ">") else arr.dtype
        if dtype not in _SAVE_TYPES and dtype not in _SAVE_V3:
            raise TorchFileError(f"cannot save {where}: numpy dtype {arr.dtype} has no torch "
                                 "tensor type here")
        key = self.keys.get(id(arr))
        if key is None:
            key = self.keys[id(arr)] = len(self.storages)
            self.keep.append(arr)
            self.storages.append(np.ascontiguousarray(arr, dtype.newbyteorder("<")))
        v3 = _SAVE_V3.get(dtype)
        self.global_("torch._utils", "_rebuild_tensor_v3" if v3 else "_rebuild_tensor_v2")
        self.out += b"(("
        self.str_("storage")
        if v3:
            self.global_("torch.storage", "UntypedStorage")
        else:
            self.global_("torch", _SAVE_TYPES[dtype])
        self.str_(str(key))
        self.str_("cpu")
        self.int_(arr.size * (dtype.itemsize if v3 else 1))
        self.out += b"tQ"
        self.int_(0)  # storage offset
        self.tuple_(tuple(int(n) for n in arr.shape), where)
        strides, step = [], 1
        for n in reversed(arr.shape):  # torch's contiguous strides (a dimension of 0 counts 1)
            strides.append(step)
            step *= max(int(n), 1)
        self.tuple_(tuple(reversed(strides)), where)
        self.out += b"\x89"  # requires_grad False
        self.global_("collections", "OrderedDict")  # no backward hooks
        self.out += b")R"
        if v3:
            self.global_("torch", v3)
        self.out += b"tR"
