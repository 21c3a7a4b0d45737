"""Kernels of the oneDNN library that Paddle's CPU wheel bundles, run on Paddle's tensors' memory.

`library` loads oneDNN 3 through ctypes and holds the pieces every primitive uses; `conv` the
convolutions of the backbones; `batchnorm` their BatchNorm on blocked activations; `prelu`
their PReLU; `rows` softmax and LayerNorm over the last axis. The layers that choose between
these and Paddle's own ops live in `plsc.models` (`conv`, `batchnorm`, `prelu`, `rows`).
"""
from .batchnorm import batchnorm_plan
from .conv import (block, blocked_native, conv_backward, conv_forward, force_block, plan,
                   plan_count, release_scratch, samples_per_call, scratch_bytes)
from .library import available, version
from .prelu import prelu_plan

__all__ = ["available", "version", "plan", "plan_count", "scratch_bytes", "release_scratch",
           "samples_per_call", "conv_forward", "conv_backward", "blocked_native", "block",
           "force_block", "batchnorm_plan", "prelu_plan"]
