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


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _unit_hash(seed, epoch, index):
    """Floats in [0, 1) from (seed, epoch, index array): splitmix64 mixing, the same
    on every machine and in every process."""
    h = np.full(np.shape(index), 0x9E3779B97F4A7C15, dtype=np.uint64)
    for v in (np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF), np.uint64(int(epoch) & 0xFFFFFFFFFFFFFFFF),
              np.asarray(index).astype(np.uint64)):
        h = (h ^ v) * np.uint64(0xBF58476D1CE4E5B9)
        h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class FaceTransform:
    """Decode to RGB, resize to `image_size` ``(height, width)`` or int, flip
    horizontally with probability `flip_prob` when `train`, and return
    ``(x - mean) / std`` as a CHW float32 array.

    With ``output="uint8"`` the image is returned before normalisation, as the
    HWC uint8 RGB array it decodes to (flipped and resized), and `normalize`
    turns a batch of those into the same CHW float32 values on the device: this
    is how the trainer reads data, so that the per-image CPU work is the decode
    and the host-to-device copy is 4x smaller.

    `mean` and `std` are numbers or RGB triples. Whether sample `index` is
    flipped is a function of (`seed`, epoch, `index`), so it does not depend on
    which worker process reads it, and a resumed run flips what the
    uninterrupted run flipped; `set_epoch` changes the draw each epoch.
    """

    def __init__(self, image_size=(112, 112), train=False, flip_prob=0.5, mean=127.5, std=127.5, seed=0,
                 output="float32"):
        if output not in ("float32", "uint8"):
            raise ValueError(f"output must be 'float32' or 'uint8', got {output!r}")
        self.output = output
        self.image_size = _size(image_size)
        self.train = bool(train)
        self.flip_prob = float(flip_prob)
        self.mean = _per_channel(mean, "mean")
        self.scale = np.float32(1.0) / _per_channel(std, "std")
        self.shift = (self.mean * self.scale).astype(np.float32)
        self.seed = int(seed)
        self.epoch = 0
        self.num_samples = 0  # set by the dataset: flips are then looked up in a per-epoch table
        self._table, self._table_key = None, None

    def set_epoch(self, epoch):
        """Draw the flips of epoch `epoch` from now on."""
        self.epoch = int(epoch)

    def flips(self, index):
        """Whether sample `index` is flipped in the current epoch."""
        if not self.train or self.flip_prob <= 0:
            return False
        if index >= self.num_samples:
            return bool(_unit_hash(self.seed, self.epoch, [index])[0] < self.flip_prob)
        key = (self.seed, self.epoch, self.num_samples, self.flip_prob)
        if self._table_key != key:
            self._table = _unit_hash(self.seed, self.epoch, np.arange(self.num_samples)) < self.flip_prob
            self._table_key = key
        return bool(self._table[index])

    def __call__(self, buf, index=0):
        return self.apply(decode_image(buf), self.flips(index))

    def apply(self, img, flip=False):
        """Resize, optionally flip, and normalise an HWC uint8 RGB image."""
        size = self.image_size
        if size is not None and img.shape[:2] != size:
            shrink = img.shape[0] > size[0] or img.shape[1] > size[1]
            img = cv2.resize(img, (size[1], size[0]), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
        if self.output == "uint8":
            return cv2.flip(img, 1) if flip else img
        # One strided pass does the flip, the move to CHW and the conversion; then
        # x/std - mean/std in place (equal to (x - mean)/std up to one rounding).
        x = (img[:, ::-1] if flip else img).transpose(2, 0, 1).astype(np.float32, order="C")
        x *= self.scale
        x -= self.shift
        return x

    def normalize(self, images):
        """A batch of ``output="uint8"`` images (paddle Tensor [B, H, W, 3] uint8) as the
        CHW float32 values ``output="float32"`` gives, computed where the tensor lives."""
        import paddle

        x = images.astype("float32")
        if np.ndim(self.scale) == 0:
            x = paddle.scale(x, float(self.scale), -float(self.shift))
        else:  # per channel: [3] operands on the last (HWC) axis
            from .tensors import to_tensor  # not paddle.to_tensor: it leaks a list per call
            x = x * to_tensor(self.scale.reshape(3)) - to_tensor(self.shift.reshape(3))
        return paddle.transpose(x, [0, 3, 1, 2])
