"""MXNet RecordIO without MXNet: record framing and the ``.idx`` index.

A record is one or more parts, each an 8-byte head (the magic word, then a
word whose top 3 bits are the part flag and low 29 bits the part length)
followed by the part's bytes padded with zeros to a multiple of 4. A payload
that holds the magic word at a 4-byte-aligned position is split there; the
word itself is not stored and the reader puts it back between the parts.
The ``.idx`` file is text, one ``key<TAB>offset`` line per record.
"""
import os
import struct

import numpy as np

from ..fileio import AtomicWriter, remove_leftovers
from .errors import DataError

__all__ = ["MAGIC", "encode_record", "decode_record", "read_index", "RecordIOReader", "RecordIOWriter"]

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_HEAD = struct.Struct("<II")
WHOLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3
_MAX_LEN = (1 << 29) - 1


def _padded(n):
    return (n + 3) & ~3


def _part(flag, data):
    pad = _padded(len(data)) - len(data)
    return _HEAD.pack(MAGIC, (flag << 29) | len(data)) + data + b"\0" * pad


def encode_record(payload):
    """Frame one payload as bytes ready to append to a ``.rec`` file."""
    payload = bytes(payload)
    if len(payload) > _MAX_LEN:
        raise ValueError(f"a RecordIO payload holds at most {_MAX_LEN} bytes, got {len(payload)}")
    cuts = []
    pos = payload.find(_MAGIC_BYTES)
    while pos != -1:
        if pos % 4 == 0:
            cuts.append(pos)
            pos = payload.find(_MAGIC_BYTES, pos + 4)
        else:
            pos = payload.find(_MAGIC_BYTES, pos + 1)
    if not cuts:
        return _part(WHOLE, payload)
    parts, start = [], 0
    for i, cut in enumerate(cuts):
        parts.append(_part(FIRST if i == 0 else MIDDLE, payload[start:cut]))
        start = cut + 4
    parts.append(_part(LAST, payload[start:]))
    return b"".join(parts)


class _NeedMore(Exception):
    """The buffer ends before the record does; `need` bytes from its start are required."""

    def __init__(self, need):
        super().__init__(need)
        self.need = need


def decode_record(buf, pos=0):
    """Return ``(payload, end)`` for the record starting at ``buf[pos]``.

    Raises DataError for a bad magic word or part flag and _NeedMore when
    `buf` stops before the record does.
    """
    start, chunks = pos, []
    while True:
        if len(buf) < pos + 8:
            raise _NeedMore(pos + 8 - start)
        magic, word = _HEAD.unpack_from(buf, pos)
        if magic != MAGIC:
            raise DataError(f"bad magic word 0x{magic:08x} at byte {pos - start} of the record, "
                            f"expected 0x{MAGIC:08x}")
        flag, length = word >> 29, word & _MAX_LEN
        expected = (WHOLE, FIRST) if not chunks else (MIDDLE, LAST)
        if flag not in expected:
            raise DataError(f"part flag {flag} at byte {pos - start} of the record, expected one of {expected}")
        end = pos + 8 + length
        if len(buf) < end:
            raise _NeedMore(end - start)
        if flag == WHOLE:
            return buf[pos + 8:end], pos + 8 + _padded(length)
        chunks.append(buf[pos + 8:end])
        pos += 8 + _padded(length)
        if flag == LAST:
            return _MAGIC_BYTES.join(bytes(c) for c in chunks), pos


def read_index(idx_path):
    """Parse a ``.idx`` file into ``(keys, offsets)`` int64 arrays in file order."""
    with open(idx_path, "rb") as f:
        tokens = f.read().split()
    try:
        if len(tokens) % 2:
            raise ValueError
        keys = np.array(tokens[0::2], dtype=np.int64)
        offsets = np.array(tokens[1::2], dtype=np.int64)
    except ValueError:
        _raise_bad_index_line(idx_path)
        raise
    if len(np.unique(keys)) != len(keys):
        uniq, counts = np.unique(keys, return_counts=True)
        raise DataError(f"{idx_path}: key {int(uniq[counts > 1][0])} appears more than once; "
                        "expected each key once")
    return keys, offsets


def _raise_bad_index_line(idx_path):
    with open(idx_path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) != 2 or not all(x.lstrip(b"-").isdigit() for x in fields):
                raise DataError(f"{idx_path}:{lineno}: bad index line {line[:80]!r}, "
                                "expected 'key<TAB>offset' with two integers")


class RecordIOReader:
    """Random access to the records of a ``.rec`` file by key.

    The file handle is opened lazily and again in each new process, so one
    reader can be shared with forked DataLoader workers. Each read is one
    ``os.pread`` of the bytes up to the next record's offset.
    """

    def __init__(self, rec_path, idx_path=None):
        self.rec_path = os.fspath(rec_path)
        self.idx_path = os.fspath(idx_path) if idx_path else os.path.splitext(self.rec_path)[0] + ".idx"
        self.file_size = os.path.getsize(self.rec_path)
        self.keys, self.offsets = read_index(self.idx_path)
        order = np.argsort(self.offsets, kind="stable")
        ends = np.append(self.offsets[order][1:], self.file_size)
        self.spans = np.empty_like(self.offsets)
        self.spans[order] = np.maximum(ends - self.offsets[order], 8)
        self._sorter = np.argsort(self.keys, kind="stable")
        self._fd, self._pid = None, None

    def __len__(self):
        return len(self.keys)

    def __contains__(self, key):
        return self._find(key) is not None

    def _find(self, key):
        at = int(np.searchsorted(self.keys, key, sorter=self._sorter))
        if at < len(self.keys) and self.keys[self._sorter[at]] == key:
            return int(self._sorter[at])
        return None

    def position(self, key):
        """Index of `key` in `keys` (file order)."""
        pos = self._find(key)
        if pos is None:
            raise KeyError(f"{self.idx_path}: no record with key {key}")
        return pos

    def positions(self, keys):
        """Indices in `keys` (file order) of an array of keys that are all present."""
        keys = np.asarray(keys, dtype=np.int64)
        at = np.minimum(np.searchsorted(self.keys, keys, sorter=self._sorter), max(len(self.keys) - 1, 0))
        pos = self._sorter[at] if len(self.keys) else at
        missing = self.keys[pos] != keys if len(self.keys) else np.ones(len(keys), bool)
        if missing.any():
            raise KeyError(f"{self.idx_path}: no record with key {int(keys[missing][0])}")
        return pos

    def drop(self, positions):
        """Forget the index entries at `positions`."""
        keep = np.ones(len(self.keys), dtype=bool)
        keep[positions] = False
        self.keys, self.offsets, self.spans = self.keys[keep], self.offsets[keep], self.spans[keep]
        self._sorter = np.argsort(self.keys, kind="stable")

    def bad_offsets(self):
        """Positions whose offset leaves no room for a record head before the end of the file."""
        return np.flatnonzero((self.offsets < 0) | (self.offsets + 8 > self.file_size))

    def read(self, key):
        """The payload (bytes) stored under `key`."""
        pos = self.position(key)
        return bytes(self.read_at(int(self.offsets[pos]), int(self.spans[pos]), key))

    def read_at(self, offset, span, key=None):
        """The payload (a bytes-like view) of the record at `offset`, reading `span` bytes first."""
        if offset < 0 or offset + 8 > self.file_size:
            raise DataError(f"{self._where(key, offset)}: offset is past the end of the file ({self.file_size} "
                            f"bytes), expected an offset of at most {self.file_size - 8} (index {self.idx_path})")
        fd = self._fd if self._pid == os.getpid() else self._handle()
        buf = memoryview(os.pread(fd, span, offset))
        while True:
            try:
                return decode_record(buf)[0]
            except _NeedMore as more:
                if offset + more.need > self.file_size:
                    raise DataError(f"{self._where(key, offset)}: record is truncated, it needs {more.need} bytes "
                                    f"but the file ends after {self.file_size - offset}") from None
                buf = memoryview(os.pread(fd, more.need, offset))
            except DataError as err:
                raise DataError(f"{self._where(key, offset)}: {err}") from None

    def pread(self, offset, size):
        """Raw bytes [offset, offset + size) of the .rec file (this process's own handle)."""
        fd = self._fd if self._pid == os.getpid() else self._handle()
        return os.pread(fd, size, offset)

    def _where(self, key, offset):
        return f"{self.rec_path}: record {'' if key is None else f'key {key} '}at offset {offset}"

    def _handle(self):
        if self._pid != os.getpid():
            self._fd, self._pid = os.open(self.rec_path, os.O_RDONLY), os.getpid()
        return self._fd

    def close(self):
        """Close this process's file handle (a later read opens it again)."""
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd, self._pid = None, None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_fd"] = state["_pid"] = None
        return state

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class RecordIOWriter:
    """Append records to a ``.rec`` file and its ``.idx``.

    Both files are written under temporary names and renamed into place by
    `close()`; leaving a ``with`` block by an exception deletes them, and the
    temporary files a killed writer left of them are deleted at the start.
    """

    def __init__(self, rec_path, idx_path=None):
        self.rec_path = os.fspath(rec_path)
        self.idx_path = os.fspath(idx_path) if idx_path else os.path.splitext(self.rec_path)[0] + ".idx"
        for path in (self.rec_path, self.idx_path):
            remove_leftovers(path)
        self._rec = AtomicWriter(self.rec_path)
        try:
            self._idx = AtomicWriter(self.idx_path)
        except BaseException:
            self._rec.abort()
            raise
        self._offset = 0

    def write(self, key, payload):
        """Append `payload` as the record of integer `key`."""
        data = encode_record(payload)
        self._rec.write(data)
        self._idx.write(f"{int(key)}\t{self._offset}\n")
        self._offset += len(data)

    def close(self):
        """Rename both files into place."""
        self._finish(commit=True)

    def abort(self):
        """Delete both temporary files."""
        self._finish(commit=False)

    def _finish(self, commit):
        if self._rec is None:
            return
        files, self._rec, self._idx = (self._rec, self._idx), None, None
        try:
            for f in files:
                if commit:
                    f.commit()
                else:
                    f.abort()
        except BaseException:
            for f in files:
                f.abort()
            raise

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self._finish(commit=exc_type is None)
        return False
