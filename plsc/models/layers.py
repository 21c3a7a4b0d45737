"""Building blocks and size arithmetic shared by the backbones."""
import math

import paddle
from paddle import nn

from .batchnorm import BatchNorm1D, BatchNorm2D
from .conv import Conv2D
from .prelu import PReLU


def as_hw(size):
    """`112` or `(112, 96)` -> `(112, 96)` as a tuple of two positive ints."""
    if isinstance(size, int):
        size = (size, size)
    height, width = (int(s) for s in size)
    if height < 1 or width < 1:
        raise ValueError(f"input_size must be positive, got {size!r}")
    return height, width


def halve(n, times):
    """Output length after `times` 3x3 convolutions with stride 2 and padding 1.

    One such convolution maps n to floor((n + 2 - 3) / 2) + 1 = ceil(n / 2),
    and so does a 1x1 stride-2 convolution without padding.
    """
    for _ in range(times):
        n = (n - 1) // 2 + 1
    return n


def normal_attr(std):
    """Weights drawn from N(0, std^2)."""
    return paddle.ParamAttr(initializer=nn.initializer.Normal(0.0, std))


def kaiming_fan_out_attr(fan_out):
    """He-normal init on fan-out with ReLU gain: N(0, 2 / fan_out)."""
    return normal_attr(math.sqrt(2.0 / fan_out))


def linear_default_attrs(fan_in):
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias (PyTorch's nn.Linear default)."""
    bound = 1.0 / math.sqrt(fan_in)
    return tuple(paddle.ParamAttr(initializer=nn.initializer.Uniform(-bound, bound))
                 for _ in range(2))


def in_float32(fn, x):
    """`fn(x)` in float32 under autocast: `x` cast up from 16 bits and autocast off inside, as
    arcface_torch's backbones run their embedding layers under fp16 (IResNet's
    `self.fc(x.float() if self.fp16 else x)`). Without AMP, `fn(x)`."""
    if x.dtype != paddle.float32:
        x = x.astype("float32")
    with paddle.amp.auto_cast(enable=False):
        return fn(x)


class FrozenScaleBatchNorm1D(nn.Layer):
    """BatchNorm1D over the embedding with its scale frozen at 1 and a learnt shift.

    insightface freezes the scale of this BatchNorm. In Paddle 3.3 a BatchNorm
    whose scale has `stop_gradient=True` (or no scale) gives its shift no
    gradient, so the affine part is applied here, outside the normalisation.
    """

    def __init__(self, num_features, epsilon=1e-5):
        super().__init__()
        self.weight = self.create_parameter(
            [num_features], attr=paddle.ParamAttr(trainable=False),
            default_initializer=nn.initializer.Constant(1.0))
        self.bias = self.create_parameter([num_features], is_bias=True)
        self.norm = BatchNorm1D(num_features, epsilon=epsilon, weight_attr=False, bias_attr=False)

    def forward(self, x):
        return self.norm(x) * self.weight + self.bias


class ConvBNPReLU(nn.Sequential):
    """Conv (no bias) -> BatchNorm2D -> PReLU, optionally without the PReLU."""

    def __init__(self, in_channels, out_channels, kernel_size=1, stride=1, padding=0,
                 groups=1, activation=True, weight_attr=None):
        conv = Conv2D(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                      groups=groups, weight_attr=weight_attr, bias_attr=False)
        layers = [conv, BatchNorm2D(out_channels, epsilon=1e-5)]
        if activation:
            layers.append(PReLU(out_channels))
        super().__init__(*layers)


def count_parameters(model, trainable_only=False):
    """Number of parameter elements, leaving out BatchNorm running statistics.

    Paddle stores running mean/variance as (non-trainable) parameters; they are
    state, not weights, so they are not counted. With `trainable_only`, frozen
    weights (such as the embedding BatchNorm's scale) are left out too.
    """
    running_stats = set()
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, nn.layer.norm._BatchNormBase):
            running_stats.update((id(layer._mean), id(layer._variance)))
    total = 0
    for param in model.parameters():
        if id(param) in running_stats or (trainable_only and param.stop_gradient):
            continue
        total += int(math.prod(param.shape))
    return total
