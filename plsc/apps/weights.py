"""Backbone weights between plsc and insightface's arcface_torch (`tools/convert_weights.py`):
arcface_torch's `.pt`/`.pth` to a plsc `.pdparams`, and a plsc checkpoint or `.pdparams` to a
file arcface_torch's `get_model(name).load_state_dict(torch.load(path))` accepts. The key and
layout rules are `plsc.models.insightface`'s."""
import io
import os

import paddle

from ..checkpoint import load_paddle_file, read_meta, verify_checkpoint
from ..checkpoint.layout import BACKBONE
from ..fileio import atomic_write
from ..loading import load_strict
from ..models import build_model, from_insightface, insightface_layout, resolve_name
from ..models import to_insightface as write_insightface
from ..models.insightface import ARCFACE_INPUT_SIZE, _embedding_key
from ..models.registry import ALIASES

__all__ = ["insightface_to_pdparams", "plsc_to_insightface_file"]


def _hw(input_size):
    if input_size is None:
        return None
    size = tuple(int(n) for n in ((input_size, input_size) if isinstance(input_size, int)
                                  else input_size))
    return size if len(size) == 2 else (size[0], size[0])


def _summary(backbone, name):
    h, w = backbone.input_size
    return f"{name} ({backbone.embedding_size}-d embeddings, {h}x{w} images)"


def insightface_to_pdparams(source, model, output, input_size=None):
    """arcface_torch's weights `source` (.pt/.pth) as plsc backbone `model` (a registry name or
    alias; the embedding size from the weights, `input_size` default 112x112) written to
    `output` (.pdparams, what Global.pretrained reads). Returns a line saying what was written."""
    backbone = from_insightface(model, source, input_size=_hw(input_size))
    buf = io.BytesIO()
    paddle.save(backbone.state_dict(), buf)
    atomic_write(output, buf.getvalue())
    return f"wrote {output}: {_summary(backbone, resolve_name(model))} from {source}"


def _plsc_state(source, model, input_size, verify):
    """(state_dict, model name, embedding size, input size) of a checkpoint folder or .pdparams."""
    if os.path.isdir(source):
        meta = read_meta(source)
        verify_checkpoint(source, verify, only=(BACKBONE,))
        saved = meta.get("model")
        if model is None:
            model = saved
        elif saved and resolve_name(model) != resolve_name(saved):
            raise ValueError(f"{source} holds the backbone {saved}, not {resolve_name(model)} "
                             "(leave --model out to use the checkpoint's)")
        if input_size is None:
            input_size = (meta.get("config") or {}).get("Data", {}).get("image_size")
        file = os.path.join(source, BACKBONE)
    else:
        file = source
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no plsc weights at {file} (a checkpoint folder or a "
                                    ".pdparams file)")
    if model is None:
        raise ValueError(f"{source}: name the backbone with --model (e.g. r50, mbf, vit_t)")
    state = load_paddle_file(file)
    canonical = resolve_name(model)
    with paddle.LazyGuard():  # where the embedding size is, in plsc's keys
        layout = insightface_layout(build_model(canonical))
    key = next(e.plsc_key for e in layout if e.torch_key == _embedding_key(canonical))
    if key not in state:
        raise ValueError(f"{file}: no {key!r}: not the weights of a {canonical}")
    embedding_size = int(state[key].shape[-1])
    return state, file, canonical, embedding_size, _hw(input_size) or ARCFACE_INPUT_SIZE


def plsc_to_insightface_file(source, output, model=None, input_size=None, verify="full"):
    """plsc weights `source` (a checkpoint folder, whose meta.json names the model and input
    size, or a .pdparams file of `model`, at `input_size`, default 112x112) written to `output`
    as arcface_torch's state_dict (`plsc.models.to_insightface`). An arcface_torch model at
    112x112 is checked to be exactly what its get_model builds; any other (IResNetTiny,
    ViTDemo, another size) is written in the same layout with a note that get_model cannot
    build it. Returns the lines to print."""
    state, file, canonical, embedding_size, size = _plsc_state(source, model, input_size, verify)
    backbone = build_model(canonical, embedding_size=embedding_size, input_size=size)
    load_strict(backbone, state, f"{file} (read as {canonical} with {embedding_size}-d "
                f"embeddings at {size[0]}x{size[1]})", hint="check --model and --input-size")
    arcface = canonical in ALIASES.values() and tuple(size) == ARCFACE_INPUT_SIZE
    alias = next((a for a, c in ALIASES.items() if c == canonical), None)
    write_insightface(backbone, output, name=canonical if arcface else None)
    lines = [f"wrote {output}: {_summary(backbone, canonical)} from {file}"]
    if arcface:
        lines.append(f"arcface_torch: get_model({alias!r}, num_features={embedding_size})"
                     ".load_state_dict(torch.load(path)) reads it")
    else:
        why = (f"arcface_torch has no {canonical}" if alias is None else
               f"arcface_torch builds {alias} for {ARCFACE_INPUT_SIZE[0]}x"
               f"{ARCFACE_INPUT_SIZE[1]} images only")
        lines.append(f"note: {why}; the file has its key layout, which plsc's from_insightface "
                     "reads back")
    return lines
