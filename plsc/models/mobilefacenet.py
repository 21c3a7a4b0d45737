"""MobileFaceNet backbone, after insightface's arcface_torch (`mbf` / `mbf_large`)."""
import paddle
from paddle import nn

from .batchnorm import BatchNorm1D, BatchNorm2D
from .conv import Conv2D
from .layers import ConvBNPReLU, as_hw, count_parameters, halve, in_float32, kaiming_fan_out_attr
from ..process import cpu_setup

__all__ = ["MobileFaceNet", "mobilefacenet_large"]


def _conv_block(in_channels, out_channels, kernel_size=1, stride=1, groups=1, activation=True):
    """Conv-BN(-PReLU) with He-normal (fan-out) conv init; 'same' padding for odd kernels."""
    fan_out = out_channels * kernel_size * kernel_size
    return ConvBNPReLU(in_channels, out_channels, kernel_size, stride=stride,
                       padding=kernel_size // 2, groups=groups, activation=activation,
                       weight_attr=kaiming_fan_out_attr(fan_out))


class DepthWise(nn.Layer):
    """Inverted bottleneck: 1x1 expand to `hidden` -> depthwise 3x3(stride) -> 1x1 linear project."""

    def __init__(self, in_channels, out_channels, hidden, stride=1, residual=False):
        super().__init__()
        if residual and (stride != 1 or in_channels != out_channels):
            raise ValueError("a residual DepthWise block must keep shape (stride 1, in == out)")
        self.residual = residual
        self.layers = nn.Sequential(
            _conv_block(in_channels, hidden),
            _conv_block(hidden, hidden, 3, stride=stride, groups=hidden),
            _conv_block(hidden, out_channels, activation=False),
        )

    def forward(self, x):
        out = self.layers(x)
        return x + out if self.residual else out


def _residual_stack(channels, num_blocks, hidden):
    return nn.Sequential(*[DepthWise(channels, channels, hidden, residual=True)
                           for _ in range(num_blocks)])


class GDC(nn.Layer):
    """Global depthwise conv over the whole final map -> Linear (no bias) -> BatchNorm1D."""

    def __init__(self, channels, feature_map_size, embedding_size):
        super().__init__()
        height, width = feature_map_size
        self.dw = Conv2D(channels, channels, (height, width), groups=channels,
                         weight_attr=kaiming_fan_out_attr(channels * height * width),
                         bias_attr=False)
        self.bn = BatchNorm2D(channels, epsilon=1e-5)
        self.linear = nn.Linear(channels, embedding_size,
                                weight_attr=kaiming_fan_out_attr(embedding_size), bias_attr=False)
        self.features = BatchNorm1D(embedding_size, epsilon=1e-5)

    def forward(self, x):
        x = paddle.flatten(self.bn(self.dw(x)), start_axis=1)
        return self.features(self.linear(x))


class MobileFaceNet(nn.Layer):
    """MobileFaceNet: images `[B, 3, H, W]` -> embeddings `[B, embedding_size]`.

    Args:
        embedding_size: output feature size.
        input_size: `(H, W)` (or one int); the global depthwise conv spans the
            final `ceil(H/16) x ceil(W/16)` map.
        dropout: accepted for a uniform constructor; MobileFaceNet has no dropout
            layer, so it must be 0.
        blocks: residual blocks in the four stages; `(1, 4, 6, 2)` is insightface's
            `mbf`, `(2, 8, 12, 4)` with `scale=4` its `mbf_large`.
        scale: width multiplier of the stage channels (64·scale, 128·scale).
    """

    def __init__(self, embedding_size=512, input_size=(112, 112), dropout=0.0,
                 blocks=(1, 4, 6, 2), scale=2):
        super().__init__()
        cpu_setup.ensure()  # a run's CPU set-up (threads, malloc) unless the user chose
        if dropout:
            raise ValueError("MobileFaceNet has no dropout layer; use dropout=0.0")
        if len(blocks) != 4:
            raise ValueError(f"blocks needs 4 entries, got {blocks!r}")
        self.embedding_size = int(embedding_size)
        self.input_size = as_hw(input_size)
        self.blocks = tuple(int(b) for b in blocks)
        self.scale = int(scale)
        narrow, wide = 64 * self.scale, 128 * self.scale

        if self.blocks[0] == 1:
            stage1 = _conv_block(narrow, narrow, 3, groups=64)
        else:
            stage1 = _residual_stack(narrow, self.blocks[0], hidden=128)
        # The expansion widths (128/256/512) do not follow `scale`, as in insightface.
        self.layers = nn.Sequential(
            _conv_block(3, narrow, 3, stride=2),
            stage1,
            DepthWise(narrow, narrow, hidden=128, stride=2),
            _residual_stack(narrow, self.blocks[1], hidden=128),
            DepthWise(narrow, wide, hidden=256, stride=2),
            _residual_stack(wide, self.blocks[2], hidden=256),
            DepthWise(wide, wide, hidden=512, stride=2),
            _residual_stack(wide, self.blocks[3], hidden=256),
        )
        self.conv_sep = _conv_block(wide, 512)
        self.feature_map_size = tuple(halve(n, 4) for n in self.input_size)
        self.features = GDC(512, self.feature_map_size, self.embedding_size)

    def forward(self, x):
        # conv_sep and the GDC embedding in float32 under AMP, as arcface_torch's fp16
        return in_float32(lambda v: self.features(self.conv_sep(v)), self.layers(x))

    def num_parameters(self, trainable_only=False):
        """Weight count, without BatchNorm running statistics."""
        return count_parameters(self, trainable_only)


def mobilefacenet_large(**kwargs):
    """insightface's `mbf_large`: blocks (2, 8, 12, 4), scale 4."""
    kwargs.setdefault("blocks", (2, 8, 12, 4))
    kwargs.setdefault("scale", 4)
    return MobileFaceNet(**kwargs)
