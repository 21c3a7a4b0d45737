"""The one way plsc writes a file: under a temporary name beside it, fsync'd, then renamed
into place, with its size and checksum computed while the bytes stream through.

A reader therefore sees the old file or the whole new one, never a part, and a crash leaves
at most a `<name>.<pid>.part` file (`is_temporary`) that the next run removes. A folder is
written the same way: under `<name>.tmp` (`temp_folder`), then renamed into place
(`commit_folder`). This module is the only one in plsc that renames files.

The checksum is CRC-32 (`zlib.crc32`): it streams at several GB/s, far faster than the disk,
and catches the damage checkpoints meet (cut files, flipped bits, zeroed pages). It is no
defence against deliberate tampering; nothing here is.

The formats plsc writes have their writer here too: `write_json`, `write_npy`, `write_npz` and
`write_image` (cv2's encoders), each giving the same bytes as the library's own file writer.

One file is written in place instead: a lock file (`write_in_place`), whose lock belongs to
the file itself and would be lost by a rename.

Test hook: with the environment variable `PLSC_TEST_READ_ONLY` set to a folder, opening any
file under it for writing here, or committing a file another library wrote there
(`commit_file`, `atomic_path`), fails as on a read-only file system (EROFS).
"""
import contextlib
import errno
import json
import os
import shutil
import zlib
from typing import NamedTuple

import numpy as np

__all__ = ["FileRecord", "AtomicWriter", "atomic_write", "atomic_path", "commit_file", "copy_file",
           "checksum_file", "is_temporary", "remove_leftovers", "process_running", "free_bytes",
           "fsync_dir", "temp_folder", "commit_folder", "write_in_place", "write_json", "write_npy", "write_npz", "write_image",
           "TEMP_SUFFIX", "FOLDER_SUFFIX", "OLD_SUFFIX",
           "TEST_READ_ONLY_ENV"]

TEMP_SUFFIX = ".part"
FOLDER_SUFFIX = ".tmp"  # a folder being written
OLD_SUFFIX = ".old"  # a folder being replaced
_CHUNK = 8 << 20  # bytes read at a time when checksumming a file
TEST_READ_ONLY_ENV = "PLSC_TEST_READ_ONLY"  # test hook: writes under this folder fail (EROFS)


class FileRecord(NamedTuple):
    """What a manifest keeps of a file: its size in bytes and CRC-32 (8 hex digits)."""
    size: int
    crc32: str


def is_temporary(name):
    """Whether `name` is a temporary file of this module (a leftover when no writer runs)."""
    return name.endswith(TEMP_SUFFIX)


def remove_leftovers(path):
    """Delete the temporary files of `path` that processes no longer running here left (a
    tool killed while writing it), e.g. before a run writes `path` again. A writer's is kept."""
    folder, name = os.path.split(os.fspath(path))
    try:
        entries = os.listdir(folder or ".")
    except OSError:
        return
    for entry in entries:
        pid = entry[len(name) + 1:-len(TEMP_SUFFIX)]
        if (entry.startswith(name + ".") and is_temporary(entry) and pid.isdigit()
                and not process_running(pid)):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, entry))


def process_running(pid):
    """Whether process `pid` runs on this machine; True when that cannot be told (another
    user's process, or `pid` is not a number)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError, TypeError):
        return True
    return True


def _temp_name(path):
    return f"{path}.{os.getpid()}{TEMP_SUFFIX}"


def fsync_dir(path):
    """Make a rename in folder `path` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _refused_for_tests(path):
    """The test hook: an EROFS error for `path` when it lies under $PLSC_TEST_READ_ONLY."""
    folder = os.environ.get(TEST_READ_ONLY_ENV)
    if folder and os.path.abspath(path).startswith(os.path.join(os.path.abspath(folder), "")):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS) + f" ({TEST_READ_ONLY_ENV})", path)


def _named(err, path):
    """Give `err` the file it concerns (a failed write names none)."""
    if isinstance(err, OSError) and err.filename is None:
        err.filename = path


class AtomicWriter:
    """A binary file-like object (`write`) for `path`: `commit()` fsyncs, renames it into place
    and returns its `FileRecord`; `abort()` deletes it. As a context manager it commits when
    the block succeeds and aborts when it raises. `str` written is encoded as UTF-8."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.tmp = _temp_name(self.path)
        self.size, self._crc = 0, 0
        _refused_for_tests(self.path)
        try:
            self._file = open(self.tmp, "wb")
        except OSError as err:
            err.filename = self.path  # not its temporary name
            raise

    def write(self, data):
        if isinstance(data, str):
            data = data.encode("utf-8")
        view = memoryview(data).cast("B")
        try:
            self._file.write(view)
        except OSError as err:
            self.abort()
            _named(err, self.path)
            raise
        self._crc = zlib.crc32(view, self._crc)
        self.size += len(view)
        return len(view)

    def flush(self):
        self._file.flush()

    def sync(self):
        """Flush and fsync what was written so far (the bytes reach the disk)."""
        self._file.flush()
        os.fsync(self._file.fileno())

    @property
    def record(self):
        return FileRecord(self.size, f"{self._crc:08x}")

    def commit(self):
        """Flush, fsync, rename into place; the file's `FileRecord`."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.tmp, self.path)
        except OSError as err:
            self.abort()
            _named(err, self.path)
            raise
        fsync_dir(os.path.dirname(self.path))
        return self.record

    def abort(self):
        """Close and delete the temporary file."""
        with contextlib.suppress(OSError):
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.tmp)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.commit()
        else:
            self.abort()
        return False


def atomic_write(path, data):
    """Write `data` (bytes or str) to `path` atomically; its `FileRecord`."""
    with AtomicWriter(path) as f:
        f.write(data)
    return f.record


def copy_file(src, dst):
    """Copy file `src` to `dst` through the atomic writer; the copy's `FileRecord`."""
    with open(src, "rb") as f, AtomicWriter(dst) as out:
        shutil.copyfileobj(f, out, _CHUNK)
    return out.record


def commit_file(tmp, path):
    """Rename a file another library wrote at `tmp` to `path` the same way (fsync, rename),
    checksummed by reading it back; its `FileRecord`. On failure `tmp` is deleted."""
    try:
        _refused_for_tests(path)
        record = checksum_file(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        _named(err, path)
        raise
    fsync_dir(os.path.dirname(path))
    return record


@contextlib.contextmanager
def atomic_path(path):
    """For writers that need a path (paddle.jit, cv2, ...): yield a temporary path, then
    `commit_file` it to `path` when the block succeeds, or delete it when it raises."""
    tmp = _temp_name(os.fspath(path))
    try:
        yield tmp
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    commit_file(tmp, path)


def write_json(path, obj, indent=1):
    """`json.dumps(obj, indent=indent)` to `path` atomically; its `FileRecord`."""
    return atomic_write(path, json.dumps(obj, indent=indent))


def write_npy(path, array):
    """`array` as a `.npy` (`np.save`'s bytes) to `path` atomically; its `FileRecord`."""
    with AtomicWriter(path) as f:
        np.save(f, array)
    return f.record


def write_npz(path, arrays):
    """{name: array} as an uncompressed `.npz` (`np.savez`) to `path` atomically (no `.npz`
    appended); its `FileRecord`. Written to a real file: zipfile lays a seekable file out
    differently from a stream."""
    _refused_for_tests(path)
    tmp = _temp_name(os.fspath(path))
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(err, OSError):
            err.filename = os.fspath(path)  # not its temporary name
        raise
    return commit_file(tmp, path)


def write_image(path, image, params=(), ext=None):
    """`image` (HWC uint8, BGR as cv2 takes it) to `path` atomically, encoded by cv2 as `ext`
    (".png", ".jpg", ...; default: the extension of `path`) with `params` as `cv2.imwrite`
    takes them, so the bytes are `cv2.imwrite`'s; its `FileRecord`. OSError naming `path` when
    cv2 cannot encode it."""
    import cv2  # here: only the image writers need OpenCV
    ext = ext or os.path.splitext(os.fspath(path))[1]
    try:
        ok, data = cv2.imencode(ext, image, list(params))
    except cv2.error:
        ok = False
    if not ok:
        raise OSError(f"could not encode {path} as a {ext or 'extensionless'} image")
    return atomic_write(path, data)


def write_in_place(fd, data):
    """Replace the content of the open file `fd` by `data` (str or bytes), without a rename:
    only for a lock file, whose lock belongs to the file and would not follow a rename."""
    data = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def checksum_file(path):
    """The `FileRecord` of the file at `path`, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return FileRecord(size, f"{crc:08x}")


def free_bytes(path):
    """Free bytes for an unprivileged writer on the file system of `path` (or of its nearest
    existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def temp_folder(path):
    """A fresh, empty `<path>.tmp` to write folder `path` in (a leftover one is removed)."""
    tmp = os.fspath(path).rstrip("/") + FOLDER_SUFFIX
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def commit_folder(tmp, path):
    """Rename the finished folder `tmp` to `path`. A folder already at `path` is first renamed
    to `<path>.old` and deleted after, so a crash leaves the old or the new folder whole (and
    at most a `.old` leftover)."""
    path = os.fspath(path).rstrip("/")
    old = path + OLD_SUFFIX
    if os.path.exists(path):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))
    shutil.rmtree(old, ignore_errors=True)
    return path
