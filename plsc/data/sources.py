"""Find labelled images: a folder with one sub-folder per identity, or a list file."""
import os

from .errors import DataError

__all__ = ["IMAGE_EXTENSIONS", "scan_image_folder", "read_image_list", "text_lines"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def text_lines(path, what="list file"):
    """`(line number, stripped line)` of the text file `path`, blank lines and lines starting
    with ``#`` skipped. A missing `path` or a folder is a FileNotFoundError / IsADirectoryError
    naming it as the `what` expected (a mistyped argument: exit code 2); a file that is not
    UTF-8 text (an image, a .npy or a .rec given by mistake) is a DataError (65)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a folder, expected a {what}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist, expected a {what}")
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                line = line.strip()
                if line and not line.startswith("#"):
                    yield number, line
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not a text file (byte {err.start} is not UTF-8), "
                        f"expected a {what}") from None


def scan_image_folder(root):
    """``(paths, labels, class_names)``: sub-folders in sorted order are labels 0, 1, ...;
    images inside each (recursively) are sorted by path."""
    root = os.fspath(root)
    names = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not names:
        raise DataError(f"{root}: no identity sub-folders, expected one folder of images per identity")
    paths, labels = [], []
    for label, name in enumerate(names):
        found = []
        for dirpath, _, files in os.walk(os.path.join(root, name)):
            found += [os.path.join(dirpath, f) for f in files if f.lower().endswith(IMAGE_EXTENSIONS)]
        found.sort()
        paths += found
        labels += [label] * len(found)
    return paths, labels, names


def read_image_list(list_path, root=None):
    """``(paths, labels, line_numbers)`` from lines ``path label``.

    Relative paths are taken from `root` (default: the list file's folder);
    blank lines and lines starting with ``#`` are ignored.
    """
    list_path = os.fspath(list_path)
    root = os.path.dirname(os.path.abspath(list_path)) if root is None else os.fspath(root)
    paths, labels, lines = [], [], []
    for lineno, line in text_lines(list_path, "list file of 'path label' lines"):
        fields = line.rsplit(None, 1)
        try:
            if len(fields) != 2:
                raise ValueError
            label = int(fields[1])
        except ValueError:
            raise DataError(f"{list_path}:{lineno}: bad line {line[:80]!r}, "
                            "expected 'path label' with an integer label") from None
        paths.append(os.path.join(root, fields[0]))
        labels.append(label)
        lines.append(lineno)
    return paths, labels, lines
