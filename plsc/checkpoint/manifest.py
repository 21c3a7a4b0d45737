"""A checkpoint's `manifest.json`: the size and CRC-32 of every file in the folder (meta.json
included), written last; and the checks that find a damaged checkpoint before it is loaded.

    {"format": 1, "checksum": "crc32",
     "files": {"meta.json": {"size": 812, "crc32": "1c291ca3"}, "head_rank0/weight.npy": ...}}

`verify_checkpoint` checks a folder at one of three levels: "full" (sizes and checksums, which
reads every byte), "size" (sizes only) or "none". A checkpoint written before manifests
existed gets the checks its files allow: meta.json must parse and each head `.npy` must be as
long as its header says.
"""
import os

import numpy as np

from ..fileio import FileRecord, checksum_file, write_json
from .errors import CheckpointDamaged, read_json
from .layout import META

__all__ = ["MANIFEST", "VERIFY_LEVELS", "write_manifest", "read_manifest", "verify_checkpoint",
           "npy_problem"]

MANIFEST = "manifest.json"
VERIFY_LEVELS = ("full", "size", "none")


def write_manifest(folder, records):
    """Write `folder/manifest.json` from {path relative to folder: FileRecord}."""
    files = {name: {"size": int(r.size), "crc32": r.crc32} for name, r in sorted(records.items())}
    return write_json(os.path.join(folder, MANIFEST), {"format": 1, "checksum": "crc32", "files": files})


def read_manifest(folder):
    """{relative path: FileRecord} of `folder`'s manifest, or None when it has none."""
    file = os.path.join(folder, MANIFEST)
    if not os.path.isfile(file):
        return None
    data = read_json(file)
    try:
        return {name: FileRecord(int(r["size"]), str(r["crc32"]))
                for name, r in data["files"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CheckpointDamaged(file, "expected {'files': {name: {'size', 'crc32'}}}") from None


def npy_problem(file):
    """Why `.npy` file `file` cannot be what its header says (None when it can)."""
    try:
        with open(file, "rb") as f:
            fmt = np.lib.format
            read = (fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0)
                    else fmt.read_array_header_2_0)
            shape, _, dtype = read(f)
            header = f.tell()
    except (ValueError, EOFError, SyntaxError) as err:
        return f"not a .npy array ({err})"
    expect = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    size = os.path.getsize(file)
    if size != expect:
        return f"{size} bytes, its header ({dtype} of shape {shape}) needs {expect}"
    return None


def _check(folder, name, record, level):
    file = os.path.join(folder, name)
    if not os.path.isfile(file):
        raise CheckpointDamaged(file, "missing (listed in the manifest)")
    size = os.path.getsize(file)
    if size != record.size:
        raise CheckpointDamaged(file, f"{size} bytes, the manifest says {record.size}")
    if level == "full":
        found = checksum_file(file)
        if found.crc32 != record.crc32:
            raise CheckpointDamaged(file, f"CRC-32 {found.crc32}, the manifest says "
                                    f"{record.crc32} (its bytes changed)")


def _legacy_files(folder):
    """The head arrays of a checkpoint without a manifest (the only files with a known size)."""
    found = []
    for sub in sorted(os.listdir(folder)):
        if sub.startswith("head_rank") and os.path.isdir(os.path.join(folder, sub)):
            found += [f"{sub}/{n}" for n in sorted(os.listdir(os.path.join(folder, sub)))
                      if n.endswith(".npy")]
    return found


def verify_checkpoint(folder, level="full", share=(0, 1), only=None):
    """Raise `CheckpointDamaged` naming the first damaged file of checkpoint `folder`.

    `level`: "full", "size" or "none". `share=(r, k)` checks only every k-th file from the
    r-th (k ranks split the reading; meta.json and the manifest are checked by all);
    `only`: check just these files (relative paths, e.g. ("backbone.pdparams",))."""
    if level not in VERIFY_LEVELS:
        raise ValueError(f"Checkpoint.verify must be one of {VERIFY_LEVELS}, got {level!r}")
    meta_file = os.path.join(folder, META)
    if not os.path.isfile(meta_file):
        raise CheckpointDamaged(meta_file, "missing (an incomplete checkpoint)")
    if level == "none":
        return
    manifest = read_manifest(folder)
    if manifest is None:
        meta = read_json(meta_file)
        if isinstance(meta, dict) and meta.get("manifest"):
            raise CheckpointDamaged(os.path.join(folder, MANIFEST), "missing (meta.json says "
                                    "this checkpoint has one)")
        names = [n for n in _legacy_files(folder) if only is None or n in only]
        for name in names[share[0]::share[1]]:
            problem = npy_problem(os.path.join(folder, name))
            if problem:
                raise CheckpointDamaged(os.path.join(folder, name), problem)
        return
    if META not in manifest:
        raise CheckpointDamaged(os.path.join(folder, MANIFEST), "does not list meta.json")
    _check(folder, META, manifest[META], level)
    names = [n for n in sorted(manifest) if n != META and (only is None or n in only)]
    for name in names[share[0]::share[1]]:
        _check(folder, name, manifest[name], level)
