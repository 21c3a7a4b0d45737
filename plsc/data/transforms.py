"""Decode and normalise face images: encoded bytes -> CHW float32."""
import cv2
import numpy as np

from .errors import DataError

__all__ = ["decode_image", "FaceTransform"]

_RGB_FLAG = getattr(cv2, "IMREAD_COLOR_RGB", None)


def decode_image(buf):
    """Decode encoded image bytes to an HWC uint8 RGB array (DataError if undecodable)."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    try:
        if _RGB_FLAG is not None:
            img = cv2.imdecode(arr, _RGB_FLAG)
        else:
            img = cv2.imdecode(arr, cv2.IMREAD_COLOR)
            img = None if img is None else cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    except cv2.error:
        img = None
    if img is None:
        raise DataError(f"cannot decode the image ({len(arr)} bytes starting {bytes(arr[:8])!r}), "
                        "expected a JPEG/PNG/BMP or another format OpenCV reads")
    return img


def _size(image_size):
    if image_size is None:
        return None
    if isinstance(image_size, int):
        return image_size, image_size
    height, width = image_size
    return int(height), int(width)


def _per_channel(value, name):
    arr = np.asarray(value, dtype=np.float32)
    if arr.ndim == 0:
        return np.float32(arr)
    if arr.shape != (3,):
        raise ValueError(f"{name} must be a number or 3 numbers (R, G, B), got {value!r}")
    return arr.reshape(3, 1, 1)


def _unit_hash(*values):
    """A float in [0, 1) from integers (splitmix64 over them): the same everywhere."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return (h >> 11) / float(1 << 53)


class FaceTransform:
    """Decode to RGB, resize to `image_size` ``(height, width)`` or int, flip
    horizontally with probability `flip_prob` when `train`, and return
    ``(x - mean) / std`` as a CHW float32 array.

    `mean` and `std` are numbers or RGB triples. Whether sample `index` is
    flipped is a function of (`seed`, epoch, `index`), so it does not depend on
    which worker process reads it, and a resumed run flips what the
    uninterrupted run flipped; `set_epoch` changes the draw each epoch.
    """

    def __init__(self, image_size=(112, 112), train=False, flip_prob=0.5, mean=127.5, std=127.5, seed=0):
        self.image_size = _size(image_size)
        self.train = bool(train)
        self.flip_prob = float(flip_prob)
        self.mean = _per_channel(mean, "mean")
        self.scale = np.float32(1.0) / _per_channel(std, "std")
        self.shift = (self.mean * self.scale).astype(np.float32)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = int(epoch)

    def flips(self, index):
        """Whether sample `index` is flipped in the current epoch."""
        return (self.train and self.flip_prob > 0
                and _unit_hash(self.seed, self.epoch, index) < self.flip_prob)

    def __call__(self, buf, index=0):
        return self.apply(decode_image(buf), self.flips(index))

    def apply(self, img, flip=False):
        """Resize, optionally flip, and normalise an HWC uint8 RGB image."""
        size = self.image_size
        if size is not None and img.shape[:2] != size:
            shrink = img.shape[0] > size[0] or img.shape[1] > size[1]
            img = cv2.resize(img, (size[1], size[0]), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
        # One strided pass does the flip, the move to CHW and the conversion; then
        # x/std - mean/std in place (equal to (x - mean)/std up to one rounding).
        x = (img[:, ::-1] if flip else img).transpose(2, 0, 1).astype(np.float32, order="C")
        x *= self.scale
        x -= self.shift
        return x
