"""Reading the embedding and label arrays the identification tools take (.npy), with one-line
errors. Their results are written by `plsc.fileio` (`write_json`, `write_npy`, re-exported here)."""
import os

import numpy as np

from ..data import DataError
from ..fileio import write_json, write_npy  # noqa: F401 (re-exported)

__all__ = ["load_npy", "load_embeddings", "load_labels", "write_json", "write_npy"]


def load_npy(path, what):
    """The array in the .npy file `path`: FileNotFoundError naming it as `what` when it is
    missing, DataError when it is not a .npy (an image, a text file, an .npz)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(6)
    if head != b"\x93NUMPY":  # an image, a text file, an .npz given by mistake
        raise DataError(f"{path}: not a .npy array (it starts with {head!r}, a .npy with "
                        "b'\\x93NUMPY')")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError) as err:
        raise DataError(f"{path}: not a .npy array ({err})") from None


def load_embeddings(path, rows=None, what="embeddings"):
    """[N, d] float32 embeddings from `path` (.npy); DataError when they are not [N, d] finite
    numbers or (with `rows`) N differs from `rows`."""
    x = load_npy(path, what)
    if x.ndim != 2 or not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise DataError(f"{path}: {what} of shape {x.shape} ({x.dtype}), expected [N, d] numbers")
    if rows is not None and len(x) != rows:
        raise DataError(f"{path}: {len(x)} {what} rows, expected {rows}")
    bad = ~np.isfinite(x).all(axis=1)
    if bad.any():
        raise DataError(f"{path}: row {int(np.argmax(bad))} is not finite ({int(bad.sum())} rows are not)")
    return x.astype(np.float32, copy=False)


def load_labels(path, rows):
    """[rows] labels (integers or strings) from `path` (.npy); DataError when the count differs."""
    y = load_npy(path, "labels")
    if y.ndim > 1:
        raise DataError(f"{path}: labels of shape {y.shape}, expected a 1-D array")
    y = y.reshape(-1)
    if len(y) != rows:
        raise DataError(f"{path}: {len(y)} labels for {rows} embeddings")
    return y

