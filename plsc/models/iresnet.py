"""Improved ResNet (IResNet) face-recognition backbones, after insightface's arcface_torch."""
import paddle
from paddle import nn

from . import blocked
from .batchnorm import BatchNorm2D
from .conv import Conv2D
from .layers import (FrozenScaleBatchNorm1D, as_hw, count_parameters, halve, in_float32,
                     linear_default_attrs, normal_attr)
from .prelu import PReLU
from .recompute import run_blocks
from ..process import cpu_setup

__all__ = ["IBasicBlock", "IResNet", "iresnet18", "iresnet34", "iresnet50", "iresnet100",
           "iresnet200", "iresnet_tiny", "IRESNET_DEPTHS"]

# Blocks per stage for each depth.
IRESNET_DEPTHS = {
    18: (2, 2, 2, 2),
    34: (3, 4, 6, 3),
    50: (3, 4, 14, 3),
    100: (3, 13, 30, 3),
    200: (6, 26, 60, 6),
}
CONV_STD = 0.1  # insightface draws every IResNet conv weight from N(0, 0.1^2)
# The stem width from which the activations stay blocked (`plsc.models.blocked`), in 16- or
# 8-channel blocks alike: arcface_torch's IResNets (64) and the demo's IResNetTiny (16-128
# channels, 56 px; 2-rank demo steps of 251-266 ms blocked against 325-329 ms plain with
# AVX-512, since PReLU runs on oneDNN). Its BatchNorm is then oneDNN's, which rounds otherwise
# than Paddle's. A stem of 8 stays plain. docs/performance.md, "IResNet50's step, primitive by
# primitive", "The demo's wall time" and "PReLU on oneDNN".
BLOCKED_FROM_WIDTH = 16


def _conv(in_channels, out_channels, kernel_size, stride=1):
    return Conv2D(in_channels, out_channels, kernel_size, stride=stride,
                  padding=kernel_size // 2, weight_attr=normal_attr(CONV_STD), bias_attr=False)


def _bn(channels):
    return BatchNorm2D(channels, epsilon=1e-5)


class IBasicBlock(nn.Layer):
    """BN -> conv3x3 -> BN -> PReLU -> conv3x3(stride) -> BN, plus a shortcut.

    The shortcut is a 1x1 conv + BN when the stride or channel count changes.
    """

    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        self.bn1 = _bn(in_channels)
        self.conv1 = _conv(in_channels, out_channels, 3)
        self.bn2 = _bn(out_channels)
        self.prelu = PReLU(out_channels)
        self.conv2 = _conv(out_channels, out_channels, 3, stride)
        self.bn3 = _bn(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(_conv(in_channels, out_channels, 1, stride),
                                            _bn(out_channels))

    def forward(self, x):
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return out + shortcut


class IResNet(nn.Layer):
    """IResNet backbone: images `[B, 3, H, W]` -> embeddings `[B, embedding_size]`.

    Args:
        layers: blocks in each of the four stages, e.g. `(3, 4, 14, 3)` for IResNet50.
        widths: channels of the four stages; the stem uses `widths[0]`.
        embedding_size: output feature size.
        input_size: `(H, W)` (or one int) of the input images; it fixes the
            flattened size feeding the final Linear, `widths[-1] * ceil(H/16) * ceil(W/16)`.
        dropout: dropout probability before the final Linear.
        zero_init_residual: start each block's middle BN scale at 0 (insightface's option).
        recompute: in training, recompute each block's activations in the backward instead of
            keeping them (`plsc.models.recompute`); the results are the same.
    """

    def __init__(self, layers, widths=(64, 128, 256, 512), embedding_size=512,
                 input_size=(112, 112), dropout=0.0, zero_init_residual=False, recompute=False):
        super().__init__()
        cpu_setup.ensure()  # a run's CPU set-up (threads, malloc) unless the user chose
        self.recompute = bool(recompute)
        if len(layers) != 4 or len(widths) != 4:
            raise ValueError(f"IResNet needs 4 stages, got layers={layers!r}, widths={widths!r}")
        if min(layers) < 1:
            raise ValueError(f"every stage needs at least one block, got layers={layers!r}")
        self.layers_per_stage = tuple(int(n) for n in layers)
        self.widths = tuple(int(w) for w in widths)
        self.embedding_size = int(embedding_size)
        self.input_size = as_hw(input_size)

        self.conv1 = _conv(3, self.widths[0], 3)
        # on oneDNN, activations stay blocked from the stem to the last BatchNorm
        self.conv1.emit_blocked = (self.widths[0] >= BLOCKED_FROM_WIDTH
                                   and all(w % blocked.block() == 0 for w in self.widths))
        self.bn1 = _bn(self.widths[0])
        self.prelu = PReLU(self.widths[0])
        in_channels = self.widths[0]
        stages = []
        for num_blocks, width in zip(self.layers_per_stage, self.widths):
            stages.append(self._make_stage(in_channels, width, num_blocks))
            in_channels = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages

        self.feature_map_size = tuple(halve(n, 4) for n in self.input_size)
        flat_size = in_channels * self.feature_map_size[0] * self.feature_map_size[1]
        self.bn2 = _bn(in_channels)
        self.dropout = nn.Dropout(p=dropout)
        weight_attr, bias_attr = linear_default_attrs(flat_size)
        self.fc = nn.Linear(flat_size, self.embedding_size, weight_attr=weight_attr,
                            bias_attr=bias_attr)
        self.features = FrozenScaleBatchNorm1D(self.embedding_size)

        if zero_init_residual:
            for block in self.sublayers():
                if isinstance(block, IBasicBlock):
                    block.bn2.weight.set_value(paddle.zeros_like(block.bn2.weight))

    @staticmethod
    def _make_stage(in_channels, out_channels, num_blocks):
        blocks = [IBasicBlock(in_channels, out_channels, stride=2)]
        blocks += [IBasicBlock(out_channels, out_channels) for _ in range(num_blocks - 1)]
        return nn.Sequential(*blocks)

    def forward(self, x):
        blocks = [(self.conv1, self.bn1, self.prelu)]  # the stem, at full resolution
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            blocks += list(stage)
        x = run_blocks(blocks, x, self.recompute and self.training)
        x = self.bn2(x)
        if blocked.is_blocked(x):
            x = blocked.to_plain(x)
        x = paddle.flatten(self.dropout(x), start_axis=1)
        return in_float32(lambda v: self.features(self.fc(v)), x)  # as arcface_torch's fp16

    def num_parameters(self, trainable_only=False):
        """Weight count, without BatchNorm running statistics."""
        return count_parameters(self, trainable_only)


OPTIONS = ("recompute",)  # constructor settings of the registry's (`plsc.models.model_options`)


def _by_depth(depth):
    def build(**kwargs):
        return IResNet(IRESNET_DEPTHS[depth], **kwargs)
    build.options = OPTIONS
    build.__name__ = f"iresnet{depth}"
    build.__doc__ = f"IResNet{depth}: stages {IRESNET_DEPTHS[depth]}; keyword args as `IResNet`."
    return build


iresnet18 = _by_depth(18)
iresnet34 = _by_depth(34)
iresnet50 = _by_depth(50)
iresnet100 = _by_depth(100)
iresnet200 = _by_depth(200)


def iresnet_tiny(layers=(1, 1, 1, 1), widths=(16, 32, 64, 128), **kwargs):
    """A small IResNet for CPU demos (one block per stage, 16..128 channels)."""
    return IResNet(layers, widths=widths, **kwargs)


iresnet_tiny.options = OPTIONS
