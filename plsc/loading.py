"""The one rule for putting weights into a backbone, used by the trainer (Global.pretrained,
resume), the tools and `Entry`:

- `load_strict`: every tensor of the model is in the state with its shape, and the state has
  nothing else; otherwise a ConfigError of one line naming the source and the tensors, and
  nothing is loaded (Paddle's own `set_state_dict` would skip them with a warning and leave
  them at their initial values).
- `check_meta`: a checkpoint folder's meta.json (model, embedding size, image size) against
  the config before anything is read; each difference is named in one line with the `-o`
  that would match.

arcface_torch's `.pt`/`.pth` keep their own key and shape check (`plsc.models.insightface`)."""
import json

from .config import ConfigError
from .models import resolve_name

__all__ = ["state_mismatch", "load_strict", "meta_differences", "check_meta"]

_SHOWN = 3  # keys named per kind of difference


def _shape(value):
    return [int(n) for n in getattr(value, "shape", ())]


def _some(keys):
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


def state_mismatch(layer, state):
    """None when `state` holds exactly `layer`'s state_dict keys with their shapes; else a
    phrase naming the first mis-shaped, missing and unexpected tensors."""
    want = {k: _shape(v) for k, v in layer.state_dict().items()}
    got = {k: _shape(v) for k, v in state.items()}
    shaped = [k for k in want if k in got and got[k] != want[k]]
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    parts = []
    if shaped:
        k = shaped[0]
        more = f" (and {len(shaped) - 1} more tensors of another shape)" if len(shaped) > 1 else ""
        parts.append(f"{k} has shape {got[k]}, the model's is {want[k]}{more}")
    if missing:
        parts.append(f"missing {_some(missing)}")
    if extra:
        parts.append(f"unexpected {_some(extra)}")
    return "; ".join(parts) or None


def load_strict(layer, state, source,
                hint="check Model.name, Model.embedding_size and Data.image_size"):
    """Set `layer`'s weights from `state` (a state_dict read from `source`, named in the error)
    when `state_mismatch` finds nothing; else raise ConfigError (ending with `hint`, what
    chose the model) and leave `layer` untouched."""
    what = state_mismatch(layer, state)
    if what:
        raise ConfigError(f"{source} does not fit the model: {what}; nothing loaded ({hint})")
    layer.set_state_dict(state)


def _image_size(meta):
    size = ((meta.get("config") or {}).get("Data") or {}).get("image_size")
    return [int(n) for n in size] if size else None


def meta_differences(meta, cfg, by_name=True):
    """[(key, checkpoint's value, config's value)] for Model.name (when `by_name`: not for a
    backbone given as a Layer), Model.embedding_size and Data.image_size, where the
    checkpoint's meta.json records the value and it differs from `cfg`'s."""
    out = []
    if by_name and meta.get("model"):
        try:
            saved = resolve_name(meta["model"])
        except ValueError:
            saved = meta["model"]
        if saved != resolve_name(cfg["Model"]["name"]):
            out.append(("Model.name", saved, resolve_name(cfg["Model"]["name"])))
    if meta.get("embedding_size") is not None:
        if int(meta["embedding_size"]) != int(cfg["Model"]["embedding_size"]):
            out.append(("Model.embedding_size", int(meta["embedding_size"]),
                        int(cfg["Model"]["embedding_size"])))
    size = _image_size(meta)
    if size is not None and size != [int(n) for n in cfg["Data"]["image_size"]]:
        out.append(("Data.image_size", size, [int(n) for n in cfg["Data"]["image_size"]]))
    return out


def _override(key, value):
    text = json.dumps(value, separators=(",", ":")) if isinstance(value, list) else str(value)
    return f'-o "{key}={text}"' if isinstance(value, list) else f"-o {key}={text}"


def check_meta(path, meta, cfg, by_name=True, more=()):
    """Raise ConfigError, one line, when checkpoint `path`'s `meta` differs from `cfg`
    (`meta_differences`, plus the (key, checkpoint's, config's) triples `more` that differ),
    naming each value on both sides and the `-o` options that would match."""
    diffs = meta_differences(meta, cfg, by_name) + [d for d in more if d[1] != d[2]]
    if diffs:
        raise ConfigError(
            f"checkpoint {path} was trained with "
            + ", ".join(f"{key}={saved}" for key, saved, _ in diffs)
            + "; the config has " + ", ".join(str(now) for _, _, now in diffs)
            + ": add " + " ".join(_override(key, saved) for key, saved, _ in diffs))
