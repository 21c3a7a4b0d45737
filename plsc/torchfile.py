"""PyTorch's file format without torch: `load` reads what `torch.save` writes (its zip format,
the default since torch 1.6) into numpy arrays and plain Python values, and `save` writes dicts,
lists and tuples of numpy arrays and plain values as a file that
`torch.load(path, weights_only=True)` reads.

The file `torch.save` writes (torch 2.x) is an uncompressed zip archive whose records sit in one
folder, named after the file's stem when torch saved to a path (`archive` when it saved to a
buffer; a renamed file keeps its old folder name)::

    <folder>/data.pkl                  the object, pickle protocol 2, tensors as calls of
                                       torch._utils._rebuild_tensor_v2 on persistent storages
    <folder>/.format_version           "1" (storage records follow one another in key order)
    <folder>/.storage_alignment        "64" (record data starts at a multiple of 64 bytes)
    <folder>/byteorder                 "little" or "big" (absent in older files: little)
    <folder>/data/<key>                each storage's raw bytes, in that byte order
    <folder>/version                   "3\\n"
    <folder>/.data/serialization_id    a random id

A tensor in `data.pkl` is `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
backward_hooks[, metadata])`, and the storage is the persistent id
`('storage', <torch.FloatStorage class ...>, key, location, numel)`; several tensors (views)
may share one storage. Dtypes without a legacy storage class (uint16, uint32, uint64, float8 ...)
use `_rebuild_tensor_v3(..., dtype)` on a `torch.storage.UntypedStorage` of bytes.

`load` unpickles with a restricted unpickler: it resolves only the globals listed in
`_GLOBALS` (torch's tensor rebuild functions, storage classes and dtypes, `torch.Size`,
`torch.device`, `collections.OrderedDict`/`Counter`, and the builtins protocol-2 pickles use for
sets, bytes, bytearrays and complex numbers); any other global is refused with a
`TorchFileError` naming it, before anything is called. What comes back:

- every tensor (and `nn.Parameter`) as a C-contiguous numpy array of its view (storage
  offset, size and stride honoured), owning its memory; `requires_grad`, backward hooks and
  Python attributes of tensors are dropped;
- float32/float64/float16, int64/int32/int16/int8, uint8/uint16/uint32/uint64, bool and
  complex64/complex128 as those numpy dtypes; **bfloat16 as float32** (numpy has no bfloat16):
  each value exactly, its 16 bits as the high half of the float32;
- a torch dtype object as a `TorchDtype` (a `str`, e.g. "torch.float32"), a `torch.device` as
  its string ("cpu", "cuda:0"), a `torch.Size` as a tuple; dicts, OrderedDicts (with the
  `_metadata` attribute `Module.state_dict()` gives them), lists, tuples, sets, numbers,
  strings, bytes and None as themselves.

Refused, each with a one-line `TorchFileError` naming the file: a file of torch's legacy
format (torch < 1.6, or `_use_new_zipfile_serialization=False`), a damaged zip (cut short, a
CRC mismatch, a record of the wrong size), a TorchScript archive, a storage saved bare (not as
a tensor), a tensor view that reaches outside its storage, dtypes numpy lacks (float8, qint8,
complex32).

`save` hand-writes pickle protocol 2 as torch does (Python's pickler would need the torch
classes): `collections.OrderedDict` stays an OrderedDict, every numpy array becomes a tensor
with a storage of its own (C order, little-endian; one array object given twice shares one
storage), numpy scalars become Python numbers. It writes the records torch needs to load the
file (`data.pkl`, `byteorder`, `data/<key>`, `version`), uncompressed, with each record's data
at a multiple of 64 bytes as torch aligns them (so `torch.load(..., mmap=True)` maps them
aligned), through `plsc.fileio.AtomicWriter`. Zip64 records are written where a record or the
archive passes 4 GiB.
"""
import collections
import io
import math
import os
import pickle
import struct
import zipfile
import zlib

import numpy as np

from .fileio import AtomicWriter

__all__ = ["load", "save", "TorchFileError", "TorchDtype"]

LEGACY_MESSAGE = ("saved by torch < 1.6 with the legacy format (or with "
                  "_use_new_zipfile_serialization=False); re-save it with torch >= 1.6")
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"  # pickled magic number
_READ_CHUNK = 64 << 20  # bytes read from a storage record at a time
_ALIGN = 64  # record data alignment, torch's default `.storage_alignment`
_ZIP64_LIMIT = 0xFFFFFFFF  # sizes and offsets from here on need zip64 fields
_BATCH = 1000  # items per SETITEMS/APPENDS, as Python's pickler batches


class TorchFileError(ValueError):
    """A file `load` cannot read (damaged, legacy format, a refused global ...) or an object
    `save` cannot write; the message is one line and names the file."""


class TorchDtype(str):
    """A torch dtype object found in a file, as its name ("torch.float32"); `numpy` is the
    numpy dtype of its elements (None where numpy has none), bfloat16 as uint16 bits."""

    def __new__(cls, name, numpy_dtype):
        self = super().__new__(cls, f"torch.{name}")
        self.numpy = None if numpy_dtype is None else np.dtype(numpy_dtype)
        return self


_BF16 = "bfloat16"  # storage kind of bfloat16: uint16 bits in the file, float32 out

# legacy storage class -> element type (the numpy dtype; bfloat16 -> _BF16)
_STORAGE_TYPES = {
    "FloatStorage": "f4", "DoubleStorage": "f8", "HalfStorage": "f2", "BFloat16Storage": _BF16,
    "LongStorage": "i8", "IntStorage": "i4", "ShortStorage": "i2", "CharStorage": "i1",
    "ByteStorage": "u1", "BoolStorage": "?", "ComplexFloatStorage": "c8",
    "ComplexDoubleStorage": "c16",
}
# torch dtype names as torch >= 2 pickles them (`torch.float32` ...) -> element type
_DTYPES = {
    "float32": "f4", "float64": "f8", "float16": "f2", "bfloat16": _BF16, "int64": "i8",
    "int32": "i4", "int16": "i2", "int8": "i1", "uint8": "u1", "uint16": "u2", "uint32": "u4",
    "uint64": "u8", "bool": "?", "complex64": "c8", "complex128": "c16",
    # dtypes numpy has no type for: allowed as values, refused as tensor dtypes
    "complex32": None, "float8_e4m3fn": None, "float8_e5m2": None, "float8_e4m3fnuz": None,
    "float8_e5m2fnuz": None, "float8_e8m0fnu": None, "float4_e2m1fn_x2": None, "qint8": None,
    "quint8": None, "qint32": None, "quint4x2": None, "quint2x4": None,
}


def _numpy_kind(kind):
    """The numpy dtype a storage element kind is read as (bfloat16: its uint16 bits)."""
    return np.dtype("u2") if kind == _BF16 else np.dtype(kind)


# ---------------------------------------------------------------------------------------------
# Reading


class _StorageType(str):
    """A storage class named in data.pkl (`torch.FloatStorage`, `torch.storage.UntypedStorage`):
    `kind` is its element type (None for untyped bytes)."""

    def __new__(cls, name, kind):
        self = super().__new__(cls, name)
        self.kind = kind
        return self


class _Storage:
    """One `data/<key>` record, read once: `raw` holds its bytes (uint8)."""

    def __init__(self, key, raw, kind, big_endian):
        self.key, self.raw, self.kind, self.big_endian = key, raw, kind, big_endian
        self.taken = False  # the buffer has been handed out as a tensor (later views copy it)


class _TensorType(str):
    """`torch.Tensor` / `torch.nn.Parameter`: the types `_rebuild_from_type_v2` may name."""


class _Reader:
    """The state of one `load`: the zip archive, its folder prefix, the storages read."""

    def __init__(self, path, zf, prefix, big_endian):
        self.path, self.zf, self.prefix, self.big_endian = path, zf, prefix, big_endian
        self.storages = {}
        self.persistent_loads = 0  # storages the pickle asked for
        self.consumed = 0  # ... and those handed to a tensor rebuild

    def fail(self, reason):
        raise TorchFileError(f"{self.path}: {' '.join(str(reason).split())}")  # one line

    def storage(self, key, kind, numel):
        if key in self.storages:
            return self.storages[key]
        name = f"{self.prefix}data/{key}"
        itemsize = 1 if kind is None else _numpy_kind(kind).itemsize
        try:
            info = self.zf.getinfo(name)
        except KeyError:
            self.fail(f"damaged PyTorch file: no record {name!r} for storage {key!r}")
        if not isinstance(numel, int) or numel < 0 or info.file_size != numel * itemsize:
            self.fail(f"damaged PyTorch file: record {name!r} holds {info.file_size} bytes, its "
                      f"storage {numel!r} elements of {itemsize} bytes")
        raw = np.empty(info.file_size, np.uint8)
        view = memoryview(raw)
        pos = 0
        try:
            with self.zf.open(info) as f:  # zipfile checks the CRC-32 when it reads the last byte
                while pos < info.file_size:
                    chunk = f.read(min(_READ_CHUNK, info.file_size - pos))
                    if not chunk:
                        break
                    view[pos:pos + len(chunk)] = chunk
                    pos += len(chunk)
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as err:
            self.fail(f"damaged PyTorch zip file: record {name!r}: {err}")
        if pos != info.file_size:
            self.fail(f"damaged PyTorch zip file: record {name!r} is cut short")
        storage = self.storages[key] = _Storage(key, raw, kind, self.big_endian)
        return storage

    def tensor(self, storage, offset, size, stride, kind=None, metadata=None):
        """The C-contiguous numpy array of a view of `storage`; `kind` overrides the storage's
        element type (`_rebuild_tensor_v3`'s dtype)."""
        if not isinstance(storage, _Storage):
            self.fail(f"malformed data.pkl: a tensor rebuilt from {type(storage).__name__}, "
                      "not from a storage")
        self.consumed += 1
        kind = storage.kind if kind is None else kind
        if kind is None:
            kind = "u1"  # an untyped storage without a dtype: bytes
        dtype = _numpy_kind(kind)
        ok = (isinstance(offset, int) and offset >= 0 and isinstance(size, tuple)
              and isinstance(stride, tuple) and len(size) == len(stride)
              and all(isinstance(n, int) and n >= 0 for n in size + stride))
        if not ok:
            self.fail(f"malformed tensor in data.pkl: offset {offset!r}, size {size!r}, "
                      f"stride {stride!r}")
        if storage.raw.size % dtype.itemsize:
            self.fail(f"storage {storage.key!r} of {storage.raw.size} bytes read as {kind!r} "
                      f"elements of {dtype.itemsize} bytes")
        numel = storage.raw.size // dtype.itemsize
        count = math.prod(size)
        if count and offset + sum((n - 1) * s for n, s in zip(size, stride)) >= numel:
            self.fail(f"tensor view (offset {offset}, size {size}, stride {stride}) reaches "
                      f"outside its storage {storage.key!r} of {numel} elements")
        file_dtype = dtype.newbyteorder(">" if storage.big_endian else "<")
        if count == 0:
            out = np.empty(size, dtype)
        else:
            elements = storage.raw.view(file_dtype)
            if (offset == 0 and count == numel and not storage.taken
                    and file_dtype.isnative and _contiguous(size, stride)):
                storage.taken = True  # the whole storage in C order: hand the buffer out
                out = elements.reshape(size)
            else:
                view = np.lib.stride_tricks.as_strided(
                    elements[offset:], shape=size,
                    strides=tuple(s * dtype.itemsize for s in stride), writeable=False)
                out = np.array(view, dtype=dtype, order="C")
        if kind == _BF16:
            out = (out.astype(np.uint32) << 16).view(np.float32)
        if metadata:
            if not isinstance(metadata, dict) or set(metadata) - {"neg", "conj"}:
                self.fail(f"tensor metadata {metadata!r} is not supported")
            if metadata.get("neg"):
                out = np.negative(out)
            if metadata.get("conj"):
                out = np.conj(out)
        return out


def _contiguous(size, stride):
    """Whether (size, stride) is C order (dimensions of one element have any stride)."""
    expected = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _device(kind, index=None):
    return kind if index is None else f"{kind}:{index}"


def _encode(text, encoding="utf-8"):
    """`_codecs.encode`, as protocol-2 pickles rebuild bytes: `encode(str, 'latin1')`."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise pickle.UnpicklingError(f"_codecs.encode({type(text).__name__}, {encoding!r}) "
                                     "is not supported")
    return text.encode(encoding)


def _globals():
    """(module, name) -> the object `find_class` returns; `None` values are filled per load
    (the rebuild functions, which need the reader)."""
    table = {("collections", "OrderedDict"): collections.OrderedDict,
             ("collections", "Counter"): collections.Counter,
             ("torch", "Size"): tuple, ("torch", "device"): _device,
             ("_codecs", "encode"): _encode}
    for module in ("builtins", "__builtin__"):
        for name, value in (("set", set), ("frozenset", frozenset), ("bytearray", bytearray),
                            ("complex", complex)):
            table[module, name] = value
    for name, kind in _STORAGE_TYPES.items():
        table["torch", name] = _StorageType(f"torch.{name}", kind)
    for module in ("torch", "torch.storage"):
        table[module, "UntypedStorage"] = _StorageType("torch.UntypedStorage", None)
    for name, kind in _DTYPES.items():
        table["torch", name] = TorchDtype(name, None if kind is None else _numpy_kind(kind))
    for module, name in (("torch", "Tensor"), ("torch._tensor", "Tensor"),
                         ("torch.nn.parameter", "Parameter"), ("torch.nn", "Parameter")):
        table[module, name] = _TensorType(f"{module}.{name}")
    for name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                 "_rebuild_parameter", "_rebuild_parameter_with_state"):
        table["torch._utils", name] = None
    for module in ("torch._tensor", "torch.tensor"):
        for name in ("_rebuild_from_type", "_rebuild_from_type_v2"):
            table[module, name] = None
    return table


_GLOBALS = _globals()


class _Unpickler(pickle.Unpickler):
    """Resolves only `_GLOBALS`; storages come from the zip archive of `reader`."""

    def __init__(self, file, reader):
        super().__init__(file, encoding="utf-8")
        self.reader = reader

        def rebuild_v2(storage, offset, size, stride, requires_grad=False, hooks=None,
                       metadata=None):
            return reader.tensor(storage, offset, tuple(size), tuple(stride), metadata=metadata)

        def rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype,
                       metadata=None):
            if not isinstance(dtype, TorchDtype):
                reader.fail(f"malformed data.pkl: tensor dtype {dtype!r}")
            if dtype.numpy is None:
                reader.fail(f"tensor of dtype {dtype}, which numpy has no type for")
            kind = _BF16 if dtype == "torch.bfloat16" else dtype.numpy.str
            return reader.tensor(storage, offset, tuple(size), tuple(stride), kind=kind,
                                 metadata=metadata)

        def rebuild_v1(storage, offset, size, stride):
            return reader.tensor(storage, offset, tuple(size), tuple(stride))

        def rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
            return data

        def rebuild_from_type(func, new_type, args, state):
            if func not in (rebuild_v1, rebuild_v2, rebuild_v3) or \
                    not isinstance(new_type, _TensorType):
                reader.fail(f"malformed data.pkl: _rebuild_from_type_v2 of {new_type!r}")
            return func(*args)

        self.functions = {
            "_rebuild_tensor": rebuild_v1, "_rebuild_tensor_v2": rebuild_v2,
            "_rebuild_tensor_v3": rebuild_v3, "_rebuild_parameter": rebuild_parameter,
            "_rebuild_parameter_with_state": rebuild_parameter,
            "_rebuild_from_type": rebuild_from_type, "_rebuild_from_type_v2": rebuild_from_type,
        }

    def find_class(self, module, name):
        if (module, name) not in _GLOBALS:
            self.reader.fail(f"data.pkl refers to the global '{module}.{name}', which is not "
                             "a tensor, storage or plain container; refusing to load it "
                             "(plsc loads weights, not arbitrary Python objects)")
        value = _GLOBALS[module, name]
        return self.functions[name] if value is None else value

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")
                and isinstance(pid[1], _StorageType)):
            self.reader.fail(f"malformed data.pkl: persistent id {pid!r:.200}")
        _, storage_type, key, _location, numel = pid
        if isinstance(key, bytes):
            key = key.decode("ascii")
        self.reader.persistent_loads += 1
        return self.reader.storage(str(key), storage_type.kind, numel)


def _find_prefix(path, names):
    """The folder (with its '/') of the one data.pkl in the archive."""
    pkls = [n for n in names if n == "data.pkl" or n.endswith("/data.pkl")]
    if not pkls:
        raise TorchFileError(f"{path}: a zip archive without data.pkl, not a file of "
                             "torch.save")
    if len(pkls) > 1:
        raise TorchFileError(f"{path}: a zip archive with several data.pkl records "
                             f"({', '.join(sorted(pkls)[:4])}), not a file of torch.save")
    prefix = pkls[0][:-len("data.pkl")]
    if prefix + "constants.pkl" in names:
        raise TorchFileError(f"{path}: a TorchScript archive (torch.jit.save); plsc reads "
                             "files of torch.save")
    return prefix


def _not_zip_reason(head):
    """Why a file that does not start as a zip archive (`head`: its first bytes) is refused."""
    if not head:
        return "an empty file, not a PyTorch file"
    if head.startswith(_LEGACY_MAGIC) or head[257:262] == b"ustar" or head.startswith(b"\x80"):
        return LEGACY_MESSAGE  # torch's legacy pickle (magic number first) or older tar file
    return "not a PyTorch file (neither a zip archive nor torch's legacy format)"


def load(path):
    """The object `torch.save` wrote to `path`, every tensor as a numpy array (bfloat16 as
    float32 of the same values); see the module's documentation. `TorchFileError` (one line,
    naming the file) when the file cannot be read as such."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(512)
    if not head.startswith(b"PK"):
        raise TorchFileError(f"{path}: {_not_zip_reason(head)}")
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, EOFError, struct.error, ValueError) as err:
        raise TorchFileError(f"{path}: damaged PyTorch zip file "
                             f"({' '.join(str(err).split())})") from None
    with zf:
        names = zf.namelist()
        prefix = _find_prefix(path, names)
        reader = _Reader(path, zf, prefix, big_endian=False)
        try:
            order = zf.read(prefix + "byteorder") if prefix + "byteorder" in names else b"little"
            data = zf.read(prefix + "data.pkl")
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as err:
            reader.fail(f"damaged PyTorch zip file: {err}")
        if order not in (b"little", b"big"):
            reader.fail(f"unknown byteorder record {order[:20]!r}")
        reader.big_endian = order == b"big"
        try:
            obj = _Unpickler(io.BytesIO(data), reader).load()
        except TorchFileError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError,
                AttributeError, IndexError, struct.error, UnicodeDecodeError,
                RecursionError) as err:
            reader.fail(f"damaged or malformed data.pkl ({type(err).__name__}: {err})")
        if reader.persistent_loads != reader.consumed:
            reader.fail("a storage saved bare (torch.save of a storage, not of a tensor) is "
                        "not supported")
        return obj


# ---------------------------------------------------------------------------------------------
# Writing

# numpy dtype -> (torch storage class, None) or (torch.storage.UntypedStorage, torch dtype name)
_SAVE_TYPES = {
    np.dtype("f4"): "FloatStorage", np.dtype("f8"): "DoubleStorage",
    np.dtype("f2"): "HalfStorage", np.dtype("i8"): "LongStorage", np.dtype("i4"): "IntStorage",
    np.dtype("i2"): "ShortStorage", np.dtype("i1"): "CharStorage", np.dtype("u1"): "ByteStorage",
    np.dtype("?"): "BoolStorage", np.dtype("c8"): "ComplexFloatStorage",
    np.dtype("c16"): "ComplexDoubleStorage",
}
_SAVE_V3 = {np.dtype("u2"): "uint16", np.dtype("u4"): "uint32", np.dtype("u8"): "uint64"}


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


def _zip_records(f, prefix, records):
    """Write `records` [(name, bytes-like)] as a stored (uncompressed) zip archive to `f`, each
    under folder `prefix`, its data at a multiple of `_ALIGN` bytes from the start."""
    offset, entries = 0, []
    for name, data in records:
        data = memoryview(data).cast("B")
        full = f"{prefix}/{name}".encode("utf-8")
        size, crc = data.nbytes, zlib.crc32(data)
        big = size >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
        pad = -(offset + 30 + len(full) + len(extra) + 4) % _ALIGN
        extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad  # torch's padding field
        size32 = 0xFFFFFFFF if big else size
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if big else 20, 0x0800, 0, 0, 0x21,
                             crc, size32, size32, len(full), len(extra))
        for part in (header, full, extra, data):
            f.write(part)
        entries.append((full, crc, size, offset))
        offset += len(header) + len(full) + len(extra) + size
    start, zip64 = offset, len(entries) >= 0xFFFF
    for full, crc, size, where in entries:
        fields = ([size, size] if size >= _ZIP64_LIMIT else []) + \
                 ([where] if where >= _ZIP64_LIMIT else [])
        extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
        zip64 |= bool(fields)
        size32 = 0xFFFFFFFF if size >= _ZIP64_LIMIT else size  # the value is in the zip64 field
        where32 = 0xFFFFFFFF if where >= _ZIP64_LIMIT else where
        central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45 if fields else 20,
                              45 if fields else 20, 0x0800, 0, 0, 0x21, crc, size32, size32,
                              len(full), len(extra), 0, 0, 0, 0, where32)
        f.write(central + full + extra)
        offset += len(central) + len(full) + len(extra)
    length, count = offset - start, len(entries)
    zip64 |= start >= _ZIP64_LIMIT or length >= _ZIP64_LIMIT
    if zip64:
        f.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, length,
                            start))
        f.write(struct.pack("<IIQI", 0x07064B50, 0, offset, 1))
    count16 = 0xFFFF if count >= 0xFFFF else count  # the values are in the zip64 end record
    length32 = 0xFFFFFFFF if length >= _ZIP64_LIMIT else length
    start32 = 0xFFFFFFFF if start >= _ZIP64_LIMIT else start
    f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count16, count16, length32, start32, 0))


def save(obj, path):
    """Write `obj` (a possibly nested dict/OrderedDict/list/tuple of numpy arrays and str,
    int, float, bool, None) to `path` as `torch.save` would write the same object with
    tensors for the arrays; `torch.load(path, weights_only=True)` reads it. Written through
    `plsc.fileio.AtomicWriter`; returns the file's `FileRecord`. `TorchFileError` for what
    cannot be saved (other types, dtypes without a torch type, a cycle)."""
    path = os.fspath(path)
    pickler = _Pickler()
    data = pickler.dump(obj)
    stem = os.path.splitext(os.path.basename(path))[0] or "archive"
    records = [("data.pkl", data), ("byteorder", b"little")]
    records += [(f"data/{key}", arr.reshape(-1).view(np.uint8))
                for key, arr in enumerate(pickler.storages)]
    records.append(("version", b"3\n"))
    with AtomicWriter(path) as f:
        _zip_records(f, stem, records)
    return f.record

