"""Writing a file `torch.load` reads: the pickle and the storages as an uncompressed zip
archive, each record's data aligned as torch aligns it; `save`."""
import os
import struct
import zlib

import numpy as np

from ..fileio import AtomicWriter
from .pickler import _Pickler

_ALIGN = 64  # record data alignment, torch's default `.storage_alignment`
_ZIP64_LIMIT = 0xFFFFFFFF  # sizes and offsets from here on need zip64 fields


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
