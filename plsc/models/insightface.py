"""insightface's arcface_torch backbone weights in plsc, and plsc's backbones as arcface_torch
weights.

    model = from_insightface("r50", "backbone.pth")   # the embedding size is the file's
    to_insightface(model, "model.pt", name="r50")     # get_model("r50") loads it strictly

arcface_torch (recognition/arcface_torch/backbones: iresnet.py, mobilefacenet.py, vit.py) and
plsc build the same layers in the same order; their state_dicts differ in four ways:

- a Linear weight is `[out, in]` in torch, `[in, out]` in Paddle (transposed both ways);
- BatchNorm statistics are `running_mean`/`running_var` in torch, `_mean`/`_variance` in
  Paddle, and torch keeps a `num_batches_tracked` counter (int64, 0-d) that Paddle has not
  (dropped when read; written as 0: arcface_torch's BatchNorms use momentum 0.1, which never
  reads it);
- a PReLU's slopes are `weight` in torch, `_weight` in Paddle;
- module names: IResNet's embedding BatchNorm (`features`, scale frozen at 1) is plsc's
  `FrozenScaleBatchNorm1D`, its statistics in `features.norm`; MobileFaceNet nests every
  conv block in a `layers` Sequential (torch `layers.0.layers.0.weight`, plsc `layers.0.0.weight`;
  a residual stage `layers.3.layers.{i}.layers.{j}.layers.{k}`, plsc `layers.3.{i}.layers.{j}.{k}`)
  and its head is `features.layers.{0.layers.0, 0.layers.1, 2, 3}` (plsc `features.{dw, bn,
  linear, features}`). The ViTs have the same names. Conv and LayerNorm weights are the same.

`insightface_layout(model)` lists, for any plsc IResNet, MobileFaceNet or ViT, every arcface_torch
key with its shape and the plsc key it comes from, in torch's state_dict order; everything
else here reads it. arcface_torch builds its models for 112x112 images only (IResNet's
`fc_scale = 7 * 7`, MobileFaceNet's 7x7 GDC, the ViTs' `img_size=112`); plsc's models for
other sizes have the same keys with other shapes.
"""
import os
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import paddle
from paddle import nn

from .iresnet import IRESNET_DEPTHS, IResNet
from .layers import ConvBNPReLU, FrozenScaleBatchNorm1D
from .mobilefacenet import GDC, DepthWise, MobileFaceNet
from .registry import ALIASES, build_model, resolve_name
from .vit import VisionTransformer

__all__ = ["from_insightface", "to_insightface", "insightface_to_plsc", "plsc_to_insightface",
           "insightface_layout", "is_torch_file", "LayoutEntry", "ARCFACE_INPUT_SIZE"]

ARCFACE_INPUT_SIZE = (112, 112)  # the only size arcface_torch's get_model builds
SAME, TRANSPOSE, COUNTER = "same", "transpose", "counter"
# {"state_dict": ...}, and arcface_torch's training checkpoint (checkpoint_gpu_*.pt)
_WRAPPERS = ("state_dict", "state_dict_backbone")
_COUNTER = "num_batches_tracked"
_LIST_AT_MOST = 6  # keys named in one error line


class LayoutEntry(NamedTuple):
    """One arcface_torch state_dict entry: its key, its torch shape, the plsc state_dict key it
    comes from (None for a `num_batches_tracked` counter) and how (`same`, `transpose`,
    `counter`)."""
    torch_key: str
    shape: tuple
    plsc_key: str
    kind: str


def _join(prefix, name):
    return f"{prefix}.{name}" if prefix else name


def _shape(param):
    return tuple(int(n) for n in param.shape)


def _batch_norm(p, t, layer, stats):
    """torch's weight, bias, running_mean, running_var, num_batches_tracked; `stats` holds the
    statistics (`_mean`, `_variance`) under the plsc prefix `stats[0]`."""
    for name in ("weight", "bias"):
        if getattr(layer, name, None) is not None:
            yield LayoutEntry(_join(t, name), _shape(getattr(layer, name)), _join(p, name), SAME)
    stats_prefix, norm = stats
    yield LayoutEntry(_join(t, "running_mean"), _shape(norm._mean), _join(stats_prefix, "_mean"), SAME)
    yield LayoutEntry(_join(t, "running_var"), _shape(norm._variance),
                      _join(stats_prefix, "_variance"), SAME)
    yield LayoutEntry(_join(t, _COUNTER), (), None, COUNTER)


def _leaf(layer, p, t):
    """The entries of a layer with weights, or None when `layer` is not such a layer."""
    if isinstance(layer, FrozenScaleBatchNorm1D):
        return list(_batch_norm(p, t, layer, (_join(p, "norm"), layer.norm)))
    if isinstance(layer, nn.layer.norm._BatchNormBase):
        return list(_batch_norm(p, t, layer, (p, layer)))
    if isinstance(layer, nn.Linear):
        out = [LayoutEntry(_join(t, "weight"), _shape(layer.weight)[::-1], _join(p, "weight"),
                           TRANSPOSE)]
        if layer.bias is not None:
            out.append(LayoutEntry(_join(t, "bias"), _shape(layer.bias), _join(p, "bias"), SAME))
        return out
    if isinstance(layer, (nn.Conv2D, nn.LayerNorm)):
        return [LayoutEntry(_join(t, name), _shape(getattr(layer, name)), _join(p, name), SAME)
                for name in ("weight", "bias") if getattr(layer, name, None) is not None]
    if isinstance(layer, nn.PReLU):
        return [LayoutEntry(_join(t, "weight"), _shape(layer._weight), _join(p, "_weight"), SAME)]
    return None


_GDC_NAMES = {"dw": "layers.0.layers.0", "bn": "layers.0.layers.1", "linear": "layers.2",
              "features": "layers.3"}


def _torch_child(parent, name, child):
    """The torch name of plsc's `parent.name`: MobileFaceNet's torch modules hold their
    children in a `layers` Sequential (ConvBlock, LinearBlock, Residual), as its GDC does."""
    if isinstance(parent, GDC):
        return _GDC_NAMES[name]
    if isinstance(parent, ConvBNPReLU):  # torch ConvBlock / LinearBlock
        return f"layers.{name}"
    if (type(parent) is nn.Sequential and len(parent) and  # a residual stage: torch Residual
            all(isinstance(c, DepthWise) for c in parent.children())):
        return f"layers.{name}"
    return name


def _walk(layer, p, t, root):
    entries = _leaf(layer, p, t)
    if entries is not None:
        yield from entries
        return
    own = list(layer.named_parameters(include_sublayers=False))
    if own and not isinstance(layer, VisionTransformer):
        raise TypeError(f"{type(root).__name__}: no arcface_torch name for the parameters of "
                        f"{type(layer).__name__} {p!r}")
    for name, param in own:  # the ViT's pos_embed and mask_token, first as in torch
        yield LayoutEntry(_join(t, name), _shape(param), _join(p, name), SAME)
    for name, child in layer.named_children():
        yield from _walk(child, _join(p, name), _join(t, _torch_child(layer, name, child)), root)


def insightface_layout(model):
    """[LayoutEntry] of plsc backbone `model` (IResNet, MobileFaceNet or VisionTransformer), in
    the order of torch's state_dict. Reads shapes only (works under `paddle.LazyGuard`)."""
    if not isinstance(model, (IResNet, MobileFaceNet, VisionTransformer)):
        raise TypeError(f"arcface_torch has no counterpart of {type(model).__name__} (IResNet, "
                        "MobileFaceNet and VisionTransformer have)")
    entries = list(_walk(model, "", "", model))
    plsc_keys = [e.plsc_key for e in entries if e.plsc_key is not None]
    state_keys = list(model.state_dict())
    assert sorted(plsc_keys) == sorted(state_keys), (  # every weight mapped, once
        sorted(set(state_keys) ^ set(plsc_keys)))
    return entries


# ---------------------------------------------------------------- descriptions for messages

def _size(model):
    h, w = model.input_size
    return f"{h}x{w}"


def _describe(model):
    """'IResNet50 at 56x56', 'MobileFaceNetLarge at 112x112', 'ViT (D 256, depth 12) at ...'."""
    if isinstance(model, IResNet):
        depth = next((d for d, layers in IRESNET_DEPTHS.items()
                      if layers == model.layers_per_stage), None)
        name = (f"IResNet{depth}" if depth and model.widths == (64, 128, 256, 512) else
                f"IResNet (stages {model.layers_per_stage}, widths {model.widths})")
    elif isinstance(model, MobileFaceNet):
        known = {((1, 4, 6, 2), 2): "MobileFaceNet", ((2, 8, 12, 4), 4): "MobileFaceNetLarge"}
        name = known.get((model.blocks, model.scale),
                         f"MobileFaceNet (blocks {model.blocks}, scale {model.scale})")
    else:
        name = f"ViT (D {model.embed_dim}, depth {model.depth}, patch {model.patch_size})"
    return f"{name} at {_size(model)}"


def _keys(keys):
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:_LIST_AT_MOST])
    return shown + (f" and {len(keys) - _LIST_AT_MOST} more" if len(keys) > _LIST_AT_MOST else "")


def _size_keys(model):
    """The keys whose shapes follow the input size."""
    if isinstance(model, IResNet):
        return {"fc.weight"}
    if isinstance(model, MobileFaceNet):
        return {"features.layers.0.layers.0.weight"}
    return {"pos_embed", "feature.0.weight"}


# ---------------------------------------------------------------- reading a state_dict

def is_torch_file(path):
    """Whether `path` is a torch file: a .pt/.pth name, or a zip archive (torch.save's
    format since 1.6; Paddle's .pdparams are pickles)."""
    if os.path.splitext(str(path))[1].lower() in (".pt", ".pth"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def _unwrap(state, source):
    """The flat {key: array} of a state_dict as found in the wild: itself, {"state_dict": ...}
    (or arcface_torch's training checkpoint's "state_dict_backbone"), keys prefixed "module."
    (DistributedDataParallel)."""
    if not isinstance(state, dict):
        raise ValueError(f"{source}: holds a {type(state).__name__}, not a state_dict")
    for wrapper in _WRAPPERS:
        if isinstance(state.get(wrapper), dict):
            state = state[wrapper]
            break
    if state and all(isinstance(k, str) and k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def _read(path_or_state, source):
    if isinstance(path_or_state, (str, os.PathLike)):
        from .. import torchfile
        path = os.fspath(path_or_state)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no arcface_torch weights at {path}")
        return _unwrap(torchfile.load(path), source or path), source or path
    source = source or "state_dict"
    return _unwrap(path_or_state, source), source


def _array(value):
    if isinstance(value, paddle.Tensor):
        value = value.numpy()
    return np.asarray(value)


def _to_plsc(entry, value):
    value = _array(value)
    if entry.kind == TRANSPOSE:
        value = value.T
    return np.ascontiguousarray(value, dtype=np.float32)


def _mismatch(source, model, shapes):
    """One line: the keys whose shapes differ, with both shapes."""
    parts = [f"arcface_torch key {key!r} has shape {list(got)}, expected {list(want)}"
             for key, got, want in shapes[:_LIST_AT_MOST]]
    more = f" (and {len(shapes) - _LIST_AT_MOST} more)" if len(shapes) > _LIST_AT_MOST else ""
    hint = ""
    if {key for key, _, _ in shapes} <= _size_keys(model):
        hint = (f"; the weights are for images of another size than {_size(model)} "
                f"(arcface_torch's: {ARCFACE_INPUT_SIZE[0]}x{ARCFACE_INPUT_SIZE[1]}): set the "
                "input size")
    return f"{source}: {'; '.join(parts)}{more} for {_describe(model)}{hint}"


def insightface_to_plsc(model, state, source=None, strict=False):
    """{plsc state_dict key: float32 array} of arcface_torch `state` ({key: array}, already
    unwrapped) for `model`: Linear weights transposed, statistics and PReLU slopes renamed,
    `num_batches_tracked` dropped, in plsc's state_dict order. Keys may be a subset of the
    model's unless `strict` (then every key but the counters must be there). An unknown key, a
    missing one (strict) or a shape that differs is a ValueError of one line naming them."""
    source = source or "state_dict"
    layout = insightface_layout(model)
    by_key = {e.torch_key: e for e in layout}
    unexpected = [k for k in state if k not in by_key]
    missing = [e.torch_key for e in layout if e.kind != COUNTER and e.torch_key not in state]
    if unexpected or (strict and missing):
        parts = []
        if strict and missing:
            parts.append(f"{len(missing)} arcface_torch key(s) missing: {_keys(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected: {_keys(unexpected)}")
        raise ValueError(f"{source}: {'; '.join(parts)} for {_describe(model)}")
    shapes = [(k, tuple(np.shape(state[k])), by_key[k].shape) for k in by_key if k in state
              and tuple(np.shape(state[k])) != by_key[k].shape]
    if shapes:
        raise ValueError(_mismatch(source, model, shapes))
    converted = {e.plsc_key: _to_plsc(e, state[e.torch_key]) for e in layout
                 if e.kind != COUNTER and e.torch_key in state}
    return OrderedDict((k, converted[k]) for k in model.state_dict() if k in converted)


def _embedding_key(canonical):
    if canonical.startswith("IResNet"):
        return "fc.weight"
    if canonical.startswith("MobileFaceNet"):
        return "features.layers.2.weight"
    return "feature.2.weight"


def from_insightface(model, path_or_state, input_size=None, source=None, **build_kwargs):
    """A plsc backbone with arcface_torch weights.

    model: a registry name or alias (`"r50"`, `"IResNet50"`, `"mbf"`, `"vit_t"`, ...): the
        backbone is built for `input_size` (default 112x112) with the embedding size of the
        weights (and `build_kwargs`, e.g. `dropout`); or a plsc backbone to load into.
    path_or_state: a torch file (`.pt`/`.pth`, read by `plsc.torchfile` without torch) or a
        state_dict already loaded ({key: array}); either may be wrapped as
        {"state_dict": ...} or have DistributedDataParallel's "module." key prefix.
    source: the name errors give the weights (default the path, or "state_dict").

    Every key must be there (`num_batches_tracked` may be absent; it is dropped), no other
    key, and every shape must be the model's: otherwise a ValueError of one line names the
    keys and shapes. Returns the backbone, in the mode it was built (training).
    """
    state, source = _read(path_or_state, source)
    if isinstance(model, str):
        canonical = resolve_name(model)
        weight = state.get(_embedding_key(canonical))
        if np.ndim(weight) == 2 and "embedding_size" not in build_kwargs:
            build_kwargs["embedding_size"] = int(np.shape(weight)[0])
        model = build_model(canonical, input_size=ARCFACE_INPUT_SIZE if input_size is None
                            else input_size, **build_kwargs)
    elif input_size is not None or build_kwargs:
        raise ValueError("input_size and build arguments are for a model given by name; this "
                         f"one is built ({_describe(model)})")
    arrays = insightface_to_plsc(model, state, source, strict=True)
    params = model.state_dict()
    for key, value in arrays.items():
        target = params[key]
        if target.dtype != paddle.float32:  # a model cast to 16 bits: rounded to its dtype
            value = paddle.to_tensor(value).astype(target.dtype)
        target.set_value(value)
    return model


# ---------------------------------------------------------------- writing

def plsc_to_insightface(model):
    """OrderedDict {arcface_torch key: array} of plsc backbone `model`: float32 arrays
    (Linear weights transposed to torch's [out, in]) and every `num_batches_tracked` as an
    int64 0-d array holding 0, in torch's state_dict order."""
    params = model.state_dict()
    out = OrderedDict()
    for e in insightface_layout(model):
        if e.kind == COUNTER:
            out[e.torch_key] = np.array(0, dtype=np.int64)
            continue
        value = params[e.plsc_key]
        value = (value if value.dtype == paddle.float32 else value.astype("float32")).numpy()
        out[e.torch_key] = np.ascontiguousarray(value.T if e.kind == TRANSPOSE else value)
        assert out[e.torch_key].shape == e.shape
    return out


def _check_arcface_model(model, name):
    """That `model` is the model arcface_torch's get_model(name, num_features=E) builds."""
    canonical = resolve_name(name)
    alias = next((a for a, c in ALIASES.items() if c == canonical), None)
    if alias is None:
        raise ValueError(f"arcface_torch has no {canonical} (its get_model builds "
                         f"{', '.join(ALIASES)}); write without a name to keep plsc's layout")
    with paddle.LazyGuard():
        reference = build_model(canonical, embedding_size=model.embedding_size,
                                input_size=ARCFACE_INPUT_SIZE)
    want = [(e.torch_key, e.shape) for e in insightface_layout(reference)]
    got = [(e.torch_key, e.shape) for e in insightface_layout(model)]
    if got != want:
        what = f"{_describe(model)} is not arcface_torch's {alias} (get_model({alias!r}, " \
               f"num_features={model.embedding_size}), {_size(reference)})"
        want_shapes, got_shapes = dict(want), dict(got)
        keys = [k for k in got_shapes.keys() ^ want_shapes.keys()]
        if keys:
            raise ValueError(f"{what}: the keys differ: {_keys(sorted(keys))}")
        key = next(k for k, s in got if want_shapes[k] != s)
        raise ValueError(f"{what}: key {key!r} has shape {list(got_shapes[key])}, arcface_torch's "
                         f"{list(want_shapes[key])}")


def to_insightface(model, path, name=None):
    """Write plsc backbone `model`'s weights to `path` as arcface_torch's state_dict, which
    `get_model(name, num_features=E).load_state_dict(torch.load(path, weights_only=True))`
    accepts strictly: every key it has, float32, `num_batches_tracked` int64 0, nothing else.

    name: the arcface_torch model the file is for (an alias such as "r50" or its plsc name);
        the model must then be exactly that architecture at 112x112, else a ValueError of one
        line says where it differs. None writes any IResNet, MobileFaceNet or ViT (other
        sizes and widths too: plsc's `from_insightface` reads them back).
    Returns `path`.
    """
    from .. import torchfile
    if name is not None:
        _check_arcface_model(model, name)
    torchfile.save(plsc_to_insightface(model), path)
    return path
