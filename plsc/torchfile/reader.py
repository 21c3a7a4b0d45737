"""Reading a file of `torch.save`: the zip archive, its storage records and the tensor views
on them; `load`."""
import io
import math
import os
import pickle
import struct
import zipfile
import zlib

import numpy as np

from .elements import _BF16, TorchFileError, _numpy_kind
from .unpickler import _Unpickler

LEGACY_MESSAGE = ("saved by torch < 1.6 with the legacy format (or with "
                  "_use_new_zipfile_serialization=False); re-save it with torch >= 1.6")
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"  # pickled magic number
_READ_CHUNK = 64 << 20  # bytes read from a storage record at a time


class _Storage:
    """One `data/<key>` record, read once: `raw` holds its bytes (uint8)."""

    def __init__(self, key, raw, kind, big_endian):
        self.key, self.raw, self.kind, self.big_endian = key, raw, kind, big_endian
        self.taken = False  # the buffer has been handed out as a tensor (later views copy it)


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
