"""Independent float64 numpy forward passes (eval mode) of IResNet and MobileFaceNet.

Written from the architecture description (insightface's arcface_torch), not
from plsc's code: every stride, padding and group count below is spelled out
here. Only the weights are read from the model, by state_dict key.
"""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

EPS = 1e-5


def conv2d(x, w, stride=1, padding=0, groups=1):
    """x [N, C, H, W], w [O, C/groups, kh, kw] -> [N, O, H', W'] (cross-correlation)."""
    n, c = x.shape[:2]
    out_c, _, kh, kw = w.shape
    x = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    win = sliding_window_view(x, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride]
    ho, wo = win.shape[2:4]
    win = win.reshape(n, groups, c // groups, ho, wo, kh, kw)
    w = w.reshape(groups, out_c // groups, c // groups, kh, kw)
    return np.einsum("ngchwij,gocij->ngohw", win, w).reshape(n, out_c, ho, wo)


class Weights:
    """state_dict as float64 numpy arrays, with small layer helpers."""

    def __init__(self, model):
        self.p = {k: v.numpy().astype("float64") for k, v in model.state_dict().items()}

    def bn(self, key, x):
        p = self.p
        shape = (1, -1) + (1,) * (x.ndim - 2)
        scale = p[key + ".weight"] / np.sqrt(p[key + "._variance"] + EPS)
        return (x - p[key + "._mean"].reshape(shape)) * scale.reshape(shape) + p[key + ".bias"].reshape(shape)

    def prelu(self, key, x):
        slope = self.p[key + "._weight"].reshape(1, -1, 1, 1)
        return np.where(x > 0, x, slope * x)

    def conv(self, key, x, stride=1, padding=0, groups=1):
        return conv2d(x, self.p[key + ".weight"], stride, padding, groups)


def iresnet_forward(model, x):
    """Stem conv3x3-BN-PReLU; per stage, blocks BN-conv3x3-BN-PReLU-conv3x3(s)-BN + shortcut
    (first block of each stage: stride 2 and a conv1x1(s2)+BN shortcut); then BN,
    flatten, Linear, BatchNorm1D."""
    w = Weights(model)
    x = w.prelu("prelu", w.bn("bn1", w.conv("conv1", x, padding=1)))
    for stage, num_blocks in enumerate(model.layers_per_stage, start=1):
        for b in range(num_blocks):
            k = f"layer{stage}.{b}"
            stride = 2 if b == 0 else 1
            out = w.conv(k + ".conv1", w.bn(k + ".bn1", x), padding=1)
            out = w.prelu(k + ".prelu", w.bn(k + ".bn2", out))
            out = w.bn(k + ".bn3", w.conv(k + ".conv2", out, stride=stride, padding=1))
            if b == 0:
                x = w.bn(k + ".downsample.1", w.conv(k + ".downsample.0", x, stride=2))
            x = out + x
    x = w.bn("bn2", x).reshape(x.shape[0], -1)
    x = x @ w.p["fc.weight"] + w.p["fc.bias"]  # paddle Linear weight is [in, out]
    p = w.p  # BatchNorm1D whose statistics live in `features.norm`
    x = (x - p["features.norm._mean"]) / np.sqrt(p["features.norm._variance"] + EPS)
    return x * p["features.weight"] + p["features.bias"]


def _conv_bn(w, key, x, stride=1, padding=0, groups=1, prelu=True):
    x = w.bn(key + ".1", w.conv(key + ".0", x, stride, padding, groups))
    return w.prelu(key + ".2", x) if prelu else x


def _depthwise(w, key, x, hidden, stride, residual):
    y = _conv_bn(w, key + ".layers.0", x)                                        # 1x1 expand
    y = _conv_bn(w, key + ".layers.1", y, stride, padding=1, groups=hidden)     # dw 3x3
    y = _conv_bn(w, key + ".layers.2", y, prelu=False)                          # 1x1 project
    return x + y if residual else y


def mobilefacenet_forward(model, x):
    """insightface's mbf with blocks[0] == 1: conv3x3 s2; grouped conv3x3 (groups 64);
    DW(s2, hidden 128), residual DWs (128); DW(s2, 256), residual DWs (256); DW(s2, 512),
    residual DWs (256); conv1x1 to 512; GDC: depthwise conv over the whole map + BN,
    Linear (no bias), BatchNorm1D."""
    assert model.blocks[0] == 1
    w = Weights(model)
    x = _conv_bn(w, "layers.0", x, stride=2, padding=1)
    x = _conv_bn(w, "layers.1", x, padding=1, groups=64)
    plan = [(2, 128, None), (3, 128, model.blocks[1]), (4, 256, None), (5, 256, model.blocks[2]),
            (6, 512, None), (7, 256, model.blocks[3])]
    for index, hidden, repeats in plan:
        if repeats is None:
            x = _depthwise(w, f"layers.{index}", x, hidden, stride=2, residual=False)
        else:
            for r in range(repeats):
                x = _depthwise(w, f"layers.{index}.{r}", x, hidden, stride=1, residual=True)
    x = _conv_bn(w, "conv_sep", x)
    x = w.bn("features.bn", w.conv("features.dw", x, groups=x.shape[1]))
    x = x.reshape(x.shape[0], -1) @ w.p["features.linear.weight"]
    return w.bn("features.features", x)
