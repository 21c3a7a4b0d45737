"""An ONNX file (e.g. a model-zoo backbone such as insightface's buffalo_l `w600k_r50.onnx`) as a
backbone of the evaluation tools (`--onnx FILE`): called like a Paddle backbone, in eval mode.

plsc feeds its backbones N x 3 x H x W float32 images in RGB order, normalised as
``(x - 127.5) / 127.5`` (`plsc.data.FaceTransform`'s defaults, which every evaluation path uses).
That is also insightface's convention for its ONNX recognition models (`ArcFaceONNX.get_feat`:
``cv2.dnn.blobFromImages(..., 1/127.5, ..., (127.5,)*3, swapRB=True)`` on a BGR OpenCV image),
so the default `input="rgb"` passes plsc's tensor through unchanged. `"bgr"` reverses the
channels for a file trained on BGR images; `"rgb255"` / `"bgr255"` undo the normalisation and
feed pixel values in [0, 255], as the MXNet-converted insightface files expect (their graphs
begin with their own Sub/Mul; insightface's `ArcFaceONNX` feeds them mean 0, std 1).
"""
import os
import sys

import numpy as np

from ..config import ConfigError
from ..data import DataError, FaceTransform

__all__ = ["ONNX_INPUTS", "OnnxBackbone", "onnx_backbone", "onnx_image_size"]

# input convention of the ONNX file -> (reverse the channels, feed [0, 255] pixel values)
ONNX_INPUTS = {"rgb": (False, False), "bgr": (True, False), "rgb255": (False, True), "bgr255": (True, True)}
INSTALL_HINT = 'pip install -e ".[onnx]" (or pip install onnxruntime)'

_FLOAT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def _import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise ConfigError(f"--onnx needs onnxruntime, which is not installed: {INSTALL_HINT}") from None
    return onnxruntime


def _fixed(dim):
    """A dimension of the ONNX input as an int, or None when it is symbolic or unknown."""
    return dim if isinstance(dim, int) and dim > 0 else None


class OnnxBackbone:
    """A backbone over an onnxruntime session (CPU): `model(x)` takes a Paddle tensor (or an
    array) of N images as plsc normalises them and returns the [N, d] float32 embeddings as a
    Paddle tensor, converted to what the file expects (`input`, see `ONNX_INPUTS`) first.

    The input name and shape come from the session; a fixed batch dimension (e.g. 1) is fed
    that many images at a time (the last group padded). `threads`: onnxruntime's intra-op
    threads (the rank's share of the cores, as `plsc.process.runtime.cpu_threads` gives Paddle). The
    model is always in eval mode (`training` is False, `eval()` returns it)."""

    training = False

    def __init__(self, path, input="rgb", threads=None):
        if input not in ONNX_INPUTS:
            raise ConfigError(f"--onnx-input {input!r}: expected one of {', '.join(ONNX_INPUTS)}")
        ort = _import_onnxruntime()
        if not os.path.isfile(path):
            raise FileNotFoundError(f"ONNX file {path} does not exist")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = int(threads)
        options.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime's own exception types (InvalidProtobuf, Fail, ...)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise DataError(f"{path}: onnxruntime cannot load it ({first})") from None
        self.path, self.input, self.threads = path, input, threads
        self.reverse_channels, self.pixels = ONNX_INPUTS[input]
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise DataError(f"{path}: {len(inputs)} inputs ({', '.join(i.name for i in inputs)}), "
                            "expected one N x 3 x H x W image input")
        spec = inputs[0]
        shape = list(spec.shape)
        if len(shape) != 4 or _fixed(shape[1]) not in (None, 3) or spec.type not in _FLOAT_TYPES:
            raise DataError(f"{path}: input {spec.name!r} is {spec.type} of shape {shape}, expected "
                            "float N x 3 x H x W images")
        self.input_name, self.dtype = spec.name, _FLOAT_TYPES[spec.type]
        self.batch = _fixed(shape[0])  # None: any batch size
        h, w = _fixed(shape[2]), _fixed(shape[3])
        self.image_size = (h, w) if h and w else None  # None: any size (the config's is used)
        self.output_name = self.session.get_outputs()[0].name
        t = FaceTransform()  # plsc's normalisation: x_plsc = x·scale − mean·scale
        self._scale, self._mean = float(t.scale), float(t.mean)

    def eval(self):
        return self

    def _feed(self, x):
        """plsc's normalised RGB images -> what the file expects."""
        if self.reverse_channels:
            x = x[:, ::-1]
        if self.pixels:
            x = x / np.float32(self._scale) + np.float32(self._mean)
        return np.ascontiguousarray(x, dtype=self.dtype)

    def _run(self, x):
        return np.asarray(self.session.run([self.output_name], {self.input_name: x})[0])

    def embed(self, images):
        """[N, d] float32 numpy embeddings of N images (numpy, plsc's convention)."""
        x = self._feed(np.asarray(images, np.float32))
        n = len(x)
        if self.batch is None:
            outs = [self._run(x)] if n else []
        else:
            outs = []
            for i in range(0, n, self.batch):
                part = x[i:i + self.batch]
                rows = len(part)
                if rows < self.batch:  # the last group, padded to the fixed batch
                    part = np.concatenate([part, np.zeros((self.batch - rows,) + part.shape[1:], part.dtype)])
                outs.append(self._run(part)[:rows])
        if not outs:
            return np.zeros((0, 0), np.float32)
        out = np.concatenate([o.reshape(len(o), -1) for o in outs]).astype(np.float32, copy=False)
        if len(out) != n:
            raise DataError(f"{self.path}: {n} images gave {len(out)} embeddings (output "
                            f"{self.output_name!r} of shape {list(outs[0].shape)})")
        return out

    def __call__(self, x):
        import paddle
        arr = x.numpy() if isinstance(x, paddle.Tensor) else x
        return paddle.to_tensor(self.embed(arr))

    def __repr__(self):
        return (f"OnnxBackbone({self.path!r}, input={self.input!r}, input_name={self.input_name!r}, "
                f"batch={self.batch}, image_size={self.image_size})")


def onnx_image_size(model, cfg):
    """The image size the tools use with `model`: the ONNX input's when fixed, else the
    config's Data.image_size."""
    return tuple(model.image_size) if model.image_size else tuple(cfg["Data"]["image_size"])


def onnx_backbone(cfg, path, input="rgb"):
    """(cfg with Data.image_size set to the file's fixed input size, the `OnnxBackbone`) for
    `--onnx FILE`: the config's Model and Global.checkpoint/pretrained are not read. Paddle's
    device is set up as for a Paddle backbone (the tools keep their tensors there); the
    session gets this rank's share of the cores (`plsc.process.runtime.cpu_threads`)."""
    from ..distributed import get_rank
    from ..process.runtime import cpu_threads, select_device
    select_device(cfg["Global"]["device"], cfg["Global"]["cpu_threads"])
    model = OnnxBackbone(path, input, threads=cpu_threads(cfg["Global"]["cpu_threads"])[0])
    size = onnx_image_size(model, cfg)
    if list(size) != list(cfg["Data"]["image_size"]) and get_rank() == 0:
        print(f"plsc: images of {size[0]}x{size[1]}, the input size of {path} (Data.image_size "
              f"{list(cfg['Data']['image_size'])} is not used)", file=sys.stderr)
    return dict(cfg, Data=dict(cfg["Data"], image_size=list(size))), model
