"""Recompute (gradient checkpointing) of a backbone's blocks, with BatchNorm statistics updated
once.

`run_blocks(blocks, x, recompute=True)` runs each block through Paddle's recompute: the block's
activations are dropped after the forward and computed again in the backward, so a step keeps
only the blocks' inputs. The second forward runs in training mode, and a plain recompute lets
its BatchNorm layers update their running statistics a second time (torch's checkpoint and
arcface_torch have that flaw: the statistics then drift as if every batch were seen twice).
Here the re-run puts the statistics back as the first forward left them, so losses, gradients
and running statistics equal the run without recompute bit for bit. Random draws inside a block
(dropout, drop path) repeat exactly: recompute restores the generator's state for the re-run and
leaves it where the first forward left it.
"""
import contextlib

import paddle
from paddle.nn.layer.norm import _BatchNormBase

__all__ = ["run_blocks"]


def run_blocks(blocks, x, recompute=False):
    """`x` through `blocks` in order; with `recompute` (and gradients being recorded), each
    block's activations are recomputed in the backward instead of kept. A block is a layer or
    a tuple of layers run one after the other."""
    if not (recompute and paddle.is_grad_enabled()):
        for block in blocks:
            x = _call(block, x)
        return x
    from paddle.distributed.fleet.utils import recompute as paddle_recompute
    for block in blocks:  # (the PyLayer form, use_reentrant=True, refuses IResNet's in-place
        # ops in Paddle 3.3: "modified by an inplace operation")
        x = paddle_recompute(_first_run_updates_statistics(block), x, use_reentrant=False)
    return x


def _call(block, x):
    for layer in block if isinstance(block, tuple) else (block,):
        x = layer(x)
    return x


def _first_run_updates_statistics(block):
    """`block` as a function whose runs after the first leave BatchNorm statistics as they were."""
    runs = []

    def run(x):
        runs.append(None)
        if len(runs) == 1:
            return _call(block, x)
        with _statistics_kept(block):
            return _call(block, x)
    return run


@contextlib.contextmanager
def _statistics_kept(block):
    """Put the running mean and variance of every BatchNorm in `block` back as they were."""
    saved = [(t, t.clone()) for layer in (block if isinstance(block, tuple) else (block,))
             for sub in layer.sublayers(include_self=True)
             if isinstance(sub, _BatchNormBase) for t in (sub._mean, sub._variance)]
    try:
        yield
    finally:
        with paddle.no_grad():
            for tensor, value in saved:
                paddle.assign(value, output=tensor)
