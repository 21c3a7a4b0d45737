"""Activations kept in oneDNN's blocked layout (nChw16c or nChw8c) between a backbone's layers.

Every oneDNN convolution reorders a plain NCHW input into channels-in-blocks and its output
back, and its gradients do the same: in IResNet50's training step (batch 32, one thread, AVX-512)
262 such reorders took 0.48 s of 12.2 s (docs/performance.md, "IResNet50's step, primitive by
primitive"). A backbone whose convolutions, BatchNorms, PReLUs and residual adds all take the
blocked layout needs none of them between its stem and its last BatchNorm.

The block is the one oneDNN's convolutions choose for themselves (`block`,
`plsc.kernels.onednn.conv.block`): 16 channels where its kernels are AVX-512, 8 under AVX2
(an AVX2 CPU, or ``ONEDNN_MAX_CPU_ISA=AVX2``), decided once a process. A blocked activation is
a float32 Paddle tensor of shape [N, C/B, H, W, B], B = `block()` (channel c = B·(c // B) + c % B
of the logical [N, C, H, W]); its gradient has the same layout. The layers of `plsc.models`
that take one (`Conv2D`, `BatchNorm2D`, `PReLU`) recognise it by that shape and return one;
element-wise ops (the residual add) need nothing. A convolution starts the blocked run when it
is asked to (`Conv2D.emit_blocked`, set by IResNet) and oneDNN's own choice for it is a blocked
layout (`plsc.kernels.onednn.blocked_native`); on any other path (a GPU,
``PLSC_KERNELS=device``, export, other dtypes) nothing is blocked.
"""
import paddle

from ..kernels.onednn.conv import block  # channels a block holds (16 or 8)

__all__ = ["block", "is_blocked", "logical_shape", "to_plain", "to_blocked"]


def is_blocked(x):
    """True when `x` is a blocked activation ([N, C/B, H, W, B], B = `block()`)."""
    return x.ndim == 5 and int(x.shape[-1]) == block()


def logical_shape(x):
    """The [N, C, H, W] that the blocked `x` holds."""
    n, cb, h, w, b = (int(d) for d in x.shape)
    return [n, cb * b, h, w]


def to_plain(x):
    """The blocked `x` as a plain (contiguous) [N, C, H, W] tensor."""
    return paddle.transpose(x, [0, 1, 4, 2, 3]).reshape(logical_shape(x))


def to_blocked(x):
    """The plain [N, C, H, W] `x` (C a multiple of `block()`) as a contiguous blocked tensor."""
    n, c, h, w = (int(d) for d in x.shape)
    b = block()
    if c % b:
        raise ValueError(f"a blocked layout needs channels in multiples of {b}, got {c}")
    return paddle.transpose(x.reshape([n, c // b, b, h, w]), [0, 1, 3, 4, 2]).contiguous()
