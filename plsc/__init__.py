"""plsc: large-scale classification for PaddlePaddle.

The classifier is split by class across ranks (model parallel), the backbone
stays data-parallel, and the softmax cross entropy is computed with a few
small collectives instead of gathering logits.

    from plsc import Entry
"""

__version__ = "0.1.0"

from .process import runtime as _runtime  # noqa: E402  (does not import Paddle)

_runtime.hide_ccache_warning()  # before Paddle loads: its import warns that no ccache is on PATH
_runtime.blas_dispatch()  # before any matrix product: MKL's AVX2 kernels on AMD processors

__all__ = ["Entry", "__version__"]


def __getattr__(name):  # `from plsc import Entry` without importing paddle for `import plsc`
    if name == "Entry":
        from .entry import Entry
        return Entry
    raise AttributeError(f"module 'plsc' has no attribute {name!r}")
