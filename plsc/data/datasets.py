"""Map-style face datasets yielding ``(image, label)``: RecordIO, image folder, list file.

All share one transform (`FaceTransform`) and one policy for bad samples:
by default a DataError naming the file and key; with ``skip_bad=True`` the
sample is replaced by the next good one and the skip is counted (`num_skipped`, per process)
and its message appended to `skipped`, which `plsc.data.DataLoader` hands to the main process
(which logs it and keeps the run's count).

`data_classes` is the class count the data declare (None: unknown), `classes_from` where it
was read: a RecordIO's `property` file, a folder's identity sub-folders, a list's largest
label + 1. Training compares it with Loss.num_classes before its first step.
"""
import os
import struct

import paddle

from . import facerec, irheader
from .errors import DataError
from .recordio import _MAX_LEN, MAGIC, WHOLE, RecordIOReader
from .sources import read_image_list, scan_image_folder, text_lines
from .transforms import FaceTransform

__all__ = ["RecordIODataset", "ImageFolderDataset", "ImageListDataset", "ImagePathsDataset"]

_FAST = struct.Struct("<IIIf")  # record magic, length word, IRHeader flag and label
_MAX_CONSECUTIVE_BAD = 100


class _FaceDataset(paddle.io.Dataset):
    def __init__(self, image_size, train, transform, num_classes, skip_bad, mean, std):
        super().__init__()
        self.transform = transform or FaceTransform(image_size, train=train, mean=mean, std=std)
        self.num_classes = num_classes
        self.skip_bad = skip_bad
        self.num_skipped = 0
        self.skipped = []  # messages of skipped samples not yet taken by the loader
        self.data_classes, self.classes_from = None, "unknown"

    def _load(self, i):
        """``(encoded image, label, ref)`` of sample `i`, `ref` naming it for `_where`; DataError if bad."""
        raise NotImplementedError

    def __getitem__(self, i):
        try:
            return self._sample(i)
        except DataError as err:
            if not self.skip_bad:
                raise
            first = err
        self._skipped(first)
        for step in range(1, min(len(self), _MAX_CONSECUTIVE_BAD)):
            try:
                return self._sample((i + step) % len(self))
            except DataError as err:
                self._skipped(err)
        raise DataError(f"{first}; and the samples after it are bad too")

    def _sample(self, i):
        if self.transform.num_samples != len(self):
            self.transform.num_samples = len(self)
        buf, label, ref = self._load(i)
        try:
            return self.transform(buf, i), label
        except DataError as err:
            raise DataError(f"{self._where(ref)}: {err}") from None

    def _where(self, ref):
        """Name the file (and key) `ref` returned by `_load`."""
        return str(ref)

    def _skipped(self, err):
        self.num_skipped += 1
        self.skipped.append(str(err))

    def _check_label(self, label, ref):
        """`label` as an int; DataError naming `ref` unless it is an integer in [0, num_classes)."""
        try:
            value = int(label)
        except (ValueError, OverflowError):
            value = -1
        if value != label or value < 0 or (self.num_classes is not None and value >= self.num_classes):
            bound = "" if self.num_classes is None else f" below num_classes={self.num_classes}"
            raise DataError(f"{self._where(ref)}: label {label} is not an integer >= 0{bound}")
        return value


class RecordIODataset(_FaceDataset):
    """Images of ``root/<prefix>.rec`` indexed by ``root/<prefix>.idx``.

    insightface's layout (header record 0, images 1..N) and header-less recs
    made by im2rec are both read; an array label counts by its first element.
    `num_classes` and the default `image_size` come from ``root/property``
    when it exists (else no label bound and 112x112).
    """

    def __init__(self, root, image_size=None, train=True, transform=None, num_classes=None, skip_bad=False,
                 mean=127.5, std=127.5, prefix="train"):
        prop = os.path.join(root, "property")
        prop = facerec.read_property(prop) if os.path.exists(prop) else None
        if num_classes is None and prop:
            num_classes = prop[0]
        if image_size is None:
            image_size = prop[1:] if prop else (112, 112)
        super().__init__(image_size, train, transform, num_classes, skip_bad, mean, std)
        if prop:
            self.data_classes, self.classes_from = prop[0], "its property file"
        self.reader = RecordIOReader(os.path.join(root, prefix + ".rec"), os.path.join(root, prefix + ".idx"))
        self._drop_bad_offsets()
        self.keys, self.header = facerec.image_keys(self.reader)
        pos = self.reader.positions(self.keys)
        self._offsets = self.reader.offsets[pos]
        self._spans = self.reader.spans[pos]

    def _drop_bad_offsets(self):
        reader = self.reader
        bad = reader.bad_offsets()
        if not len(bad):
            return
        first = int(bad[0])
        msg = (f"{reader.idx_path}: key {int(reader.keys[first])} points to offset {int(reader.offsets[first])}, "
               f"past the end of {reader.rec_path} ({reader.file_size} bytes)")
        if not self.skip_bad:
            raise DataError(msg + f"; {len(bad)} index entries are bad")
        reader.drop(bad)
        self.num_skipped += len(bad)
        self.skipped.append(f"{msg}; {len(bad)} index entries dropped")

    def __len__(self):
        return len(self.keys)

    def _load(self, i):
        # Fast path for the common case: one whole record, scalar integer label in range.
        buf = self.reader.pread(int(self._offsets[i]), int(self._spans[i]))
        if len(buf) >= _FAST.size:
            magic, word, flag, label = _FAST.unpack_from(buf)
            end = 8 + (word & _MAX_LEN)
            if (magic == MAGIC and word >> 29 == WHOLE and flag == 0 and end <= len(buf)
                    and end >= 8 + irheader.HEADER_SIZE and label == int(label) and label >= 0
                    and (self.num_classes is None or label < self.num_classes)):
                return memoryview(buf)[8 + irheader.HEADER_SIZE:end], int(label), int(self.keys[i])
        return self._load_checked(i)

    def _load_checked(self, i):
        key = int(self.keys[i])
        payload = self.reader.read_at(int(self._offsets[i]), int(self._spans[i]), key)
        try:
            head, image = irheader.unpack(payload)
        except DataError as err:
            raise DataError(f"{self._where(key)}: {err}") from None
        label = head.label if head.flag == 0 else float(head.label[0])
        return image, self._check_label(label, key), key

    def _where(self, key):
        return f"{self.reader.rec_path}: key {key}"


class _FileListDataset(_FaceDataset):
    """Images stored as files, with labels known up front."""

    def __init__(self, paths, labels, describe, image_size, train, transform, num_classes, skip_bad, mean, std):
        super().__init__(image_size, train, transform, num_classes, skip_bad, mean, std)
        self.paths, self.labels = [], []
        for i, (path, label) in enumerate(zip(paths, labels)):
            try:
                label = self._check_label(label, describe(i))
            except DataError as err:
                if not skip_bad:
                    raise
                self._skipped(err)
                continue
            self.paths.append(path)
            self.labels.append(label)

    def __len__(self):
        return len(self.paths)

    def _load(self, i):
        path = self.paths[i]
        try:
            with open(path, "rb") as f:
                return f.read(), self.labels[i], path
        except OSError as err:
            raise DataError(f"{path}: cannot read the image file ({err.strerror})") from None


class ImageFolderDataset(_FileListDataset):
    """Images under ``root/<identity>/``; sorted identity folders are labels 0, 1, ..."""

    def __init__(self, root, image_size=(112, 112), train=True, transform=None, num_classes=None, skip_bad=False,
                 mean=127.5, std=127.5):
        paths, labels, self.class_names = scan_image_folder(root)
        super().__init__(paths, labels, lambda i: paths[i], image_size, train, transform, num_classes, skip_bad,
                         mean, std)
        self.data_classes, self.classes_from = len(self.class_names), "its identity folders"


class ImageListDataset(_FileListDataset):
    """Images named by a list file of ``path label`` lines (paths relative to `root`,
    by default the list file's folder)."""

    def __init__(self, list_path, root=None, image_size=(112, 112), train=True, transform=None, num_classes=None,
                 skip_bad=False, mean=127.5, std=127.5):
        paths, labels, lines = read_image_list(list_path, root)
        super().__init__(paths, labels, lambda i: f"{list_path}:{lines[i]}", image_size, train, transform,
                         num_classes, skip_bad, mean, std)
        self.data_classes = max(self.labels, default=-1) + 1
        self.classes_from = "its largest label + 1"


class ImagePathsDataset(_FileListDataset):
    """Images named by a list file of paths, one a line (relative to `root`, by default the list
    file's folder; blank lines and lines starting with ``#`` skipped), all labelled 0: e.g. a
    distractor set."""

    def __init__(self, list_path, root=None, image_size=(112, 112), train=False, transform=None,
                 mean=127.5, std=127.5):
        list_path = os.fspath(list_path)
        root = os.path.dirname(os.path.abspath(list_path)) if root is None else os.fspath(root)
        paths, lines = [], []
        for number, line in text_lines(list_path, "list of image paths"):
            paths.append(os.path.join(root, line))
            lines.append(number)
        super().__init__(paths, [0] * len(paths), lambda i: f"{list_path}:{lines[i]}", image_size, train,
                         transform, None, False, mean, std)
