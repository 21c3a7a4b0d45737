"""Inputs of the data preparation tools (tools/pack_rec.py, tools/make_verification_bin.py):
landmark lists, pairs lists (plain or LFW's pairs.txt), and a face aligned and re-encoded.

Every malformed line is a `DataError` naming the file and the line number."""
import os

import cv2
import numpy as np

from .align import align_face
from .errors import DataError
from .sources import text_lines
from .transforms import decode_image

__all__ = ["read_landmark_list", "read_pairs", "aligned_jpeg", "aligned_or_error", "resized_jpeg",
           "LANDMARK_FIELDS"]

LANDMARK_FIELDS = "path label x1 y1 x2 y2 x3 y3 x4 y4 x5 y5"


def _lines(path, what):
    for number, line in text_lines(path, what):
        yield number, line.split()


def _resolve(root, name):
    return name if root is None or os.path.isabs(name) else os.path.join(root, name)


def read_landmark_list(path, root=None, labels=True):
    """(paths, labels, landmarks [N, 5, 2] float64) of a list of `path label x1 y1 ... x5 y5`
    lines (without `labels`: `path x1 y1 ... x5 y5`, labels all 0); paths relative to `root`
    (default: the list's folder)."""
    root = os.path.dirname(os.path.abspath(path)) if root is None else root
    want = 12 if labels else 11
    paths, labs, points = [], [], []
    for number, fields in _lines(path, "landmark list"):
        if len(fields) != want:
            raise DataError(f"{path}:{number}: expected {want} fields "
                            f"'{LANDMARK_FIELDS if labels else 'path x1 y1 ... x5 y5'}', got {len(fields)}")
        try:
            label = int(fields[1]) if labels else 0
            xy = np.array([float(v) for v in fields[want - 10:]], np.float64).reshape(5, 2)
        except ValueError as err:
            raise DataError(f"{path}:{number}: {err}") from None
        if label < 0 or not np.isfinite(xy).all():
            raise DataError(f"{path}:{number}: expected a label >= 0 and finite landmarks")
        paths.append(_resolve(root, fields[0]))
        labs.append(label)
        points.append(xy)
    return paths, labs, np.array(points, np.float64).reshape(-1, 5, 2)


def read_pairs(path, root=None):
    """[(path1, path2, same)] of a pairs list: `path1 path2 same` lines (same: 1/0, true/false),
    or LFW's pairs.txt (an optional first line of counts, then `name n1 n2` for a matched pair
    and `name1 n1 name2 n2` for a mismatched one; images root/name/name_000n.jpg). Paths are
    relative to `root` (default: the list's folder)."""
    root = os.path.dirname(os.path.abspath(path)) if root is None else root
    pairs = []
    for number, fields in _lines(path, "pairs list"):
        try:
            if len(fields) == 3 and not fields[1].isdigit():  # path1 path2 same
                same = {"1": True, "0": False, "true": True, "false": False}[fields[2].lower()]
                pairs.append((_resolve(root, fields[0]), _resolve(root, fields[1]), same))
            elif len(fields) == 3:  # LFW: name n1 n2
                name, a, b = fields[0], int(fields[1]), int(fields[2])
                pairs.append((_lfw(root, name, a), _lfw(root, name, b), True))
            elif len(fields) == 4:  # LFW: name1 n1 name2 n2
                pairs.append((_lfw(root, fields[0], int(fields[1])), _lfw(root, fields[2], int(fields[3])), False))
            elif len(fields) == 2 and number == 1 and all(f.isdigit() for f in fields):
                continue  # LFW's header: folds and pairs per fold
            else:
                raise ValueError(f"{len(fields)} fields")
        except (KeyError, ValueError) as err:
            raise DataError(f"{path}:{number}: expected 'path1 path2 same(1/0)' or LFW's "
                            f"'name n1 n2' / 'name1 n1 name2 n2', got {' '.join(fields)!r} ({err})") from None
    if not pairs:
        raise DataError(f"{path}: no pairs")
    return pairs


def _lfw(root, name, n):
    return os.path.join(root, name, f"{name}_{n:04d}.jpg")


def read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err.strerror}") from None


def aligned_jpeg(path, landmarks, image_size=(112, 112), quality=95):
    """The image at `path` aligned from its five `landmarks` with `plsc.data.align.align_face`
    to `image_size` and encoded as JPEG (bytes)."""
    try:
        img = decode_image(read_bytes(path))
    except DataError as err:
        raise DataError(f"{path}: {err}") from None
    face = align_face(img, landmarks, image_size)
    ok, enc = cv2.imencode(".jpg", cv2.cvtColor(face, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:
        raise DataError(f"{path}: cannot encode the aligned face as JPEG")
    return enc.tobytes()


def aligned_or_error(image_size, quality, item):
    """(aligned JPEG bytes, None) of one (path, landmarks), or (None, the error's message)."""
    try:
        return aligned_jpeg(item[0], item[1], image_size, quality), None
    except DataError as err:
        return None, str(err)


def resized_jpeg(size, quality, path):
    """The file's bytes, or (with `size` (h, w)) the image resized and re-encoded as JPEG."""
    buf = read_bytes(path)
    if size:
        img = cv2.resize(decode_image(buf), (size[1], size[0]), interpolation=cv2.INTER_AREA)
        buf = cv2.imencode(".jpg", cv2.cvtColor(img, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])[1]
        buf = buf.tobytes()
    return buf
