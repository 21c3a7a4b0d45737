"""Activations kept in oneDNN's blocked layout (nChw16c) between a backbone's layers.

Every oneDNN convolution reorders a plain NCHW input into channels-in-blocks-of-16 and its
output back, and its gradients do the same: in IResNet50's training step (batch 32, one thread)
262 such reorders took 0.48 s of 12.2 s (docs/performance.md, "IResNet50's step, primitive by
primitive"). A backbone whose convolutions, BatchNorms, PReLUs and residual adds all take the
blocked layout needs none of them between its stem and its last BatchNorm.

A blocked activation is a float32 Paddle tensor of shape [N, C/16, H, W, 16] (channel
c = 16·(c // 16) + c % 16 of the logical [N, C, H, W]); its gradient has the same layout. The
layers of `plsc.models` that take one (`Conv2D`, `BatchNorm2D`, `PReLU`) recognise it by that
shape and return one; element-wise ops (the residual add) need nothing. A convolution starts
the blocked run when it is asked to (`Conv2D.emit_blocked`, set by IResNet) and oneDNN's own
choice for it is the blocked layout (`plsc.kernels.onednn.blocked_native`: its AVX-512 kernels); on
any other path (a GPU, ``PLSC_KERNELS=device``, export, other dtypes) nothing is blocked.
"""
import paddle

from ..kernels.onednn.conv import BLOCK  # channels a block holds (16)

__all__ = ["BLOCK", "is_blocked", "logical_shape", "to_plain", "to_blocked"]


def is_blocked(x):
    """True when `x` is a blocked activation ([N, C/16, H, W, 16])."""
    return x.ndim == 5 and int(x.shape[-1]) == BLOCK


def logical_shape(x):
    """The [N, C, H, W] that the blocked `x` holds."""
    n, cb, h, w, _ = (int(d) for d in x.shape)
    return [n, cb * BLOCK, h, w]


def to_plain(x):
    """The blocked `x` as a plain (contiguous) [N, C, H, W] tensor."""
    return paddle.transpose(x, [0, 1, 4, 2, 3]).reshape(logical_shape(x))


def to_blocked(x):
    """The plain [N, C, H, W] `x` (C a multiple of 16) as a contiguous blocked tensor."""
    n, c, h, w = (int(d) for d in x.shape)
    if c % BLOCK:
        raise ValueError(f"a blocked layout needs channels in multiples of {BLOCK}, got {c}")
    return paddle.transpose(x.reshape([n, c // BLOCK, BLOCK, h, w]), [0, 1, 3, 4, 2]).contiguous()
