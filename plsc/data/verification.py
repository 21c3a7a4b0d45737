"""Verification packs (``lfw.bin`` and the like): a pickled ``(bins, issame)``.

`bins` holds 2P encoded images, pairs ``(bins[2i], bins[2i+1])`` with
``issame[i]`` telling whether they show one identity. Packs pickled under
Python 2 (images as ``str``) load too.
"""
import os
import pickle

import cv2
import numpy as np

from ..fileio import AtomicWriter, remove_leftovers
from .errors import DataError
from .transforms import FaceTransform, decode_image

__all__ = ["read_verification_bin", "write_verification_bin", "load_verification_arrays"]


def _load_pickle(path):
    with open(path, "rb") as f:
        try:
            return pickle.load(f, encoding="bytes")
        except (UnicodeDecodeError, ValueError, TypeError):
            # numpy arrays pickled by Python 2 need latin1; str images come back as str
            f.seek(0)
            return pickle.load(f, encoding="latin1")


def _as_bytes(item, path, i):
    if isinstance(item, str):
        return item.encode("latin1")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, np.ndarray) and item.dtype == np.uint8:
        return item.tobytes()
    raise DataError(f"{path}: image {i} is a {type(item).__name__}, expected encoded image bytes")


def read_verification_bin(path, decode=True):
    """``(images, issame)``: HWC uint8 RGB arrays (encoded bytes if not `decode`)
    and a bool array with one entry per pair."""
    path = os.fspath(path)
    try:
        obj = _load_pickle(path)
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError) as err:
        raise DataError(f"{path}: not a verification pack ({type(err).__name__}: {err}), "
                        "expected a pickled (bins, issame_list)") from None
    if not isinstance(obj, (tuple, list)) or len(obj) != 2:
        raise DataError(f"{path}: holds a {type(obj).__name__}, expected a pickled (bins, issame_list) pair")
    bins, issame = obj
    issame = np.asarray(issame)
    if issame.ndim != 1 or not (issame.dtype == np.bool_ or np.isin(issame, (0, 1)).all()):
        raise DataError(f"{path}: issame_list has shape {issame.shape} and dtype {issame.dtype}, "
                        "expected one boolean per pair")
    if len(bins) != 2 * len(issame):
        raise DataError(f"{path}: {len(bins)} images for {len(issame)} pairs, expected {2 * len(issame)}")
    images = [_as_bytes(b, path, i) for i, b in enumerate(bins)]
    if decode:
        images = [_decode(b, path, i) for i, b in enumerate(images)]
    return images, issame.astype(bool)


def _decode(encoded, path, i):
    try:
        return decode_image(encoded)
    except DataError as err:
        raise DataError(f"{path}: image {i}: {err}") from None


def write_verification_bin(path, images, issame, ext=".jpg", quality=95):
    """Write a pack from HWC uint8 RGB arrays (encoded with `ext`) or encoded bytes."""
    issame = [bool(x) for x in issame]
    if len(images) != 2 * len(issame):
        raise ValueError(f"{len(images)} images for {len(issame)} pairs, expected {2 * len(issame)}")
    params = [cv2.IMWRITE_JPEG_QUALITY, int(quality)] if ext.lower() in (".jpg", ".jpeg") else []
    bins = []
    for i, img in enumerate(images):
        if isinstance(img, (bytes, bytearray)):
            bins.append(bytes(img))
            continue
        ok, enc = cv2.imencode(ext, cv2.cvtColor(np.ascontiguousarray(img), cv2.COLOR_RGB2BGR), params)
        if not ok:
            raise ValueError(f"cannot encode image {i} as {ext}")
        bins.append(enc.tobytes())
    remove_leftovers(path)  # a killed writer's temporary file
    with AtomicWriter(path) as f:
        pickle.dump((bins, issame), f, protocol=4)


def load_verification_arrays(path, image_size=(112, 112), mean=127.5, std=127.5):
    """``(data, issame)``: an ``(2P, 3, H, W)`` float32 array normalised like training
    (no flip) and the bool array. Each image is decoded and transformed into its row in turn:
    the pack's decoded images are never all held (a list of them and their stack held the
    array's size twice more, freed heap the first evaluation started among)."""
    images, issame = read_verification_bin(path, decode=False)
    transform = FaceTransform(image_size, train=False, mean=mean, std=std)
    data = np.empty((len(images), 3) + tuple(transform.image_size), np.float32)
    for i, encoded in enumerate(images):
        data[i] = transform.apply(_decode(encoded, path, i))
    return data, issame
