"""insightface's training-set layout: ``train.rec``, ``train.idx`` and ``property``.

Record 0 is a header (flag 2, labels ``[first identity key, end key]``),
images are keys ``1 .. first identity key - 1``, and each identity has a
record (flag 2, labels ``[first image key, end image key]``) from the first
identity key on. Recs made by im2rec have no header: every key is an image.
``property`` is one line ``num_classes,height,width``.
"""
import os

import numpy as np

from ..fileio import atomic_write
from . import irheader
from .errors import DataError
from .recordio import RecordIOWriter

__all__ = ["read_property", "write_property", "image_keys", "write_face_rec"]


def read_property(path):
    """``(num_classes, height, width)`` from a ``property`` file."""
    with open(path, "rb") as f:
        text = f.read(4096).decode("utf-8", "replace").strip()  # an image given as one: no crash
    try:
        num_classes, height, width = (int(x) for x in text.split(","))
    except ValueError:
        raise DataError(f"{path}: property is {text[:80]!r}, expected 'num_classes,height,width'") from None
    return num_classes, height, width


def write_property(path, num_classes, height, width):
    """Write insightface's `property` file: `num_classes,height,width`."""
    atomic_write(path, f"{int(num_classes)},{int(height)},{int(width)}\n")


def image_keys(reader):
    """``(keys, header)``: the image keys of `reader` and the header labels.

    With an insightface header the keys are the indexed keys in
    ``[1, first identity key)`` in ascending order and `header` is
    ``(first identity key, end key)``; otherwise all keys in index order
    and None.
    """
    if 0 in reader:
        payload = reader.read(0)
        try:
            head, image = irheader.unpack(payload)
        except DataError as err:
            raise DataError(f"{reader.rec_path}: key 0: {err}") from None
        if head.flag > 0 and len(image) == 0:
            first = int(head.label[0])
            end = int(head.label[1]) if head.flag > 1 else first
            keys = np.sort(reader.keys)
            return keys[(keys >= 1) & (keys < first)], (first, end)
    return reader.keys.copy(), None


def _identity_runs(labels):
    """``[(label, start, stop)]`` of runs of equal labels, or None if a label recurs."""
    runs, seen, start = [], set(), 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            if labels[start] in seen:
                return None
            seen.add(labels[start])
            runs.append((labels[start], start, i))
            start = i
    return runs


def write_face_rec(root, labels, images, image_size, num_classes=None, header=True, prefix="train"):
    """Write ``prefix.rec``, ``prefix.idx`` and ``property`` under `root`.

    `labels` holds one int per image; `images` yields the encoded images in
    the same order. With `header` the insightface layout is written (the
    identity records only when each label's images are contiguous),
    otherwise im2rec's (keys from 0). Returns the number of images.
    """
    labels = [int(x) for x in labels]
    if num_classes is None:
        num_classes = max(labels) + 1 if labels else 0
    bad = [x for x in labels if not 0 <= x < num_classes]
    if bad:
        raise DataError(f"label {bad[0]} is outside [0, {num_classes}) for {root}")
    os.makedirs(root, exist_ok=True)
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    n = len(labels)
    runs = _identity_runs(labels) if header else None
    first = n + 1
    rec = os.path.join(root, prefix + ".rec")
    with RecordIOWriter(rec, os.path.join(root, prefix + ".idx")) as writer:
        if header:
            writer.write(0, irheader.pack([first, first + len(runs or ())]))
        key = 1 if header else 0
        count = 0
        for label, image in zip(labels, images):
            writer.write(key, irheader.pack(float(label), image, id=key))
            key += 1
            count += 1
        if count != n:
            raise DataError(f"{rec}: got {count} images for {n} labels")
        for i, (_, start, stop) in enumerate(runs or ()):
            writer.write(first + i, irheader.pack([start + 1, stop + 1], id=first + i))
    write_property(os.path.join(root, "property"), num_classes, height, width)
    return n
