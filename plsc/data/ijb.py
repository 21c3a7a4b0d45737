"""IJB-B / IJB-C in the layout of insightface's IJB release, and a dataset of its aligned faces.

``ROOT`` (e.g. ``IJB_release/IJBC``) holds, for target ``ijbc`` (``ijbb``)::

    meta/ijbc_face_tid_mid.txt          image template_id media_id           (one line per image)
    meta/ijbc_name_5pts_score.txt       image x1 y1 x2 y2 ... x5 y5 det_score (same images, same order)
    meta/ijbc_template_pair_label.txt   template_1 template_2 label(1 same, 0 not)
    loose_crop/<image>

Fields are separated by blanks; blank lines are skipped. Every inconsistency raises
`DataError` (a missing file or image: `FileNotFoundError`) naming the file and line.
"""
import os
from dataclasses import dataclass

import numpy as np
import paddle

from .align import align_face
from .errors import DataError
from .transforms import decode_image

__all__ = ["IJBMeta", "ijb_paths", "read_ijb_meta", "check_ijb_images", "IJBFaceDataset"]


def ijb_paths(root, target):
    """{'face_tid_mid', 'name_5pts_score', 'template_pair_label': meta paths, 'images': folder}."""
    t = str(target).lower()
    meta = os.path.join(root, "meta")
    paths = {k: os.path.join(meta, f"{t}_{k}.txt")
             for k in ("face_tid_mid", "name_5pts_score", "template_pair_label")}
    paths["images"] = os.path.join(root, "loose_crop")
    return paths


@dataclass
class IJBMeta:
    """The protocol of one target; image arrays are in the order of `name_5pts_score`."""
    root: str
    target: str
    paths: dict
    names: list               # image file names, relative to paths["images"]
    lines: np.ndarray         # [N] line of each image in name_5pts_score
    landmarks: np.ndarray     # [N, 5, 2] float32 (x, y)
    det_scores: np.ndarray    # [N] float32 detector scores
    templates: np.ndarray     # [N] int64 template ids
    medias: np.ndarray        # [N] int64 media ids
    pairs: np.ndarray         # [P, 2] int64 template ids
    labels: np.ndarray        # [P] int64, 1 = same identity

    @property
    def num_images(self):
        """Images of the protocol (lines of `name_5pts_score`)."""
        return len(self.names)

    @property
    def num_templates(self):
        """Distinct template ids of the images."""
        return int(len(np.unique(self.templates)))

    @property
    def num_pairs(self):
        """Template pairs to verify."""
        return int(len(self.labels))


def _records(path, num_fields, what):
    """(line number, fields) of every non-blank line, checking the field count."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist (expected {what})")
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) != num_fields:
                raise DataError(f"{path} line {number}: {len(fields)} fields, expected {num_fields} "
                                f"({what})")
            yield number, fields


def _int(path, number, text, name):
    try:
        return int(text)
    except ValueError:
        raise DataError(f"{path} line {number}: {name} {text!r} is not an integer") from None


def _floats(path, number, texts, name):
    expected = "a finite number" if len(texts) == 1 else f"{len(texts)} finite numbers"
    try:
        values = [float(t) for t in texts]
    except ValueError:
        values = [np.nan]
    if not all(np.isfinite(values)):
        raise DataError(f"{path} line {number}: {name} {' '.join(texts)!r}, expected {expected}")
    return values


def read_ijb_meta(root, target):
    """Read and cross-check the three meta files of `target` ('IJBC', 'IJBB', ...) under `root`."""
    paths = ijb_paths(root, target)
    tid_path, pts_path, pair_path = (paths[k] for k in ("face_tid_mid", "name_5pts_score",
                                                         "template_pair_label"))
    tid_rows = [(n, f[0], _int(tid_path, n, f[1], "template id"), _int(tid_path, n, f[2], "media id"))
                for n, f in _records(tid_path, 3, "image template_id media_id")]
    pts_rows = [(n, f[0], _floats(pts_path, n, f[1:11], "landmarks"),
                 _floats(pts_path, n, f[11:], "detector score")[0])
                for n, f in _records(pts_path, 12, "image, 10 landmark coordinates x1 y1 ... x5 y5, "
                                                   "detector score")]
    if not pts_rows:
        raise DataError(f"{pts_path}: no images listed")
    for (n1, name1, *_), (n2, name2, *_) in zip(tid_rows, pts_rows):
        if name1 != name2:
            raise DataError(f"{pts_path} line {n2}: image {name2!r}, but {tid_path} line {n1} lists "
                            f"{name1!r}; the two files must list the same images in the same order")
    if len(tid_rows) != len(pts_rows):
        longer, rows, shorter = ((tid_path, tid_rows, pts_path) if len(tid_rows) > len(pts_rows)
                                 else (pts_path, pts_rows, tid_path))
        n, name = rows[min(len(tid_rows), len(pts_rows))][:2]
        raise DataError(f"{longer} line {n}: image {name!r} is not in {shorter} "
                        f"({len(tid_rows)} images against {len(pts_rows)}); the two files must list "
                        "the same images in the same order")
    templates = np.array([r[2] for r in tid_rows], np.int64)
    known = set(templates.tolist())
    pair_rows = []
    tid_file = os.path.basename(tid_path)
    for n, f in _records(pair_path, 3, "template_1 template_2 label"):
        t1, t2, label = (_int(pair_path, n, v, k) for v, k in zip(f, ("template", "template", "label")))
        for t in (t1, t2):
            if t not in known:
                raise DataError(f"{pair_path} line {n}: template {t} is not in {tid_file}")
        if label not in (0, 1):
            raise DataError(f"{pair_path} line {n}: label {label}, expected 1 (same) or 0 (different)")
        pair_rows.append((t1, t2, label))
    if not pair_rows:
        raise DataError(f"{pair_path}: no template pairs listed")
    pairs = np.array(pair_rows, np.int64).reshape(-1, 3)
    return IJBMeta(root=root, target=str(target), paths=paths,
                   names=[r[1] for r in pts_rows], lines=np.array([r[0] for r in pts_rows], np.int64),
                   landmarks=np.array([r[2] for r in pts_rows], np.float32).reshape(-1, 5, 2),
                   det_scores=np.array([r[3] for r in pts_rows], np.float32),
                   templates=templates, medias=np.array([r[3] for r in tid_rows], np.int64),
                   pairs=pairs[:, :2].copy(), labels=pairs[:, 2].copy())


def check_ijb_images(meta, start=0, stop=None):
    """FileNotFoundError naming the first image of `meta.names[start:stop]` that is missing."""
    folder = meta.paths["images"]
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder} does not exist (expected the folder of the images listed "
                                f"in {meta.paths['name_5pts_score']})")
    for i in range(start, len(meta.names) if stop is None else stop):
        path = os.path.join(folder, meta.names[i])
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist ({meta.paths['name_5pts_score']} line "
                                    f"{meta.lines[i]} lists it)")


class IJBFaceDataset(paddle.io.Dataset):
    """Images `start … stop-1` of `meta`, each read and aligned to `image_size` (height,
    width) in `__getitem__`: ``(HWC uint8 RGB crop, image index)``. Normalise a batch with
    `FaceTransform.normalize`, as the trainer does."""

    def __init__(self, meta, image_size=(112, 112), start=0, stop=None):
        super().__init__()
        stop = meta.num_images if stop is None else stop
        self.folder, self.list_file = meta.paths["images"], meta.paths["name_5pts_score"]
        self.names, self.lines = meta.names[start:stop], meta.lines[start:stop]
        self.landmarks = meta.landmarks[start:stop]
        self.image_size, self.start = tuple(int(v) for v in image_size), int(start)

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        path = os.path.join(self.folder, self.names[i])
        try:
            with open(path, "rb") as f:
                image = decode_image(f.read())
        except (OSError, DataError) as err:
            raise DataError(f"{path} ({self.list_file} line {self.lines[i]}): {err}") from None
        return align_face(image, self.landmarks[i], self.image_size), np.int64(self.start + i)
