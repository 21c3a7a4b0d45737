"""The table of margins, the one place their names are spelled: for each margin its config
name, its class (in `plsc.loss.margins`), whether its logits are normalised (s·cos θ; else
plain x·Wᵀ + b), which `Loss` config key feeds each constructor argument, and, for PLSC's own
loss types, the values `Entry.set_loss_type` writes. `MARGIN_KEYS` declares those config keys
(type, default, help, rule). The config schema, the training builders and `Entry` read both,
so adding a margin is a row here and its class in `margins.py` (docs/contributing.md).

No Paddle import: the config schema reads the table before Paddle loads.
"""
from typing import NamedTuple, Optional

__all__ = ["MarginKey", "MarginRow", "MARGIN_TABLE", "MARGIN_KEYS", "DEFAULT_MARGIN", "margin_row",
           "margin_names", "either", "margin_kwargs", "loss_types", "cosine_options",
           "check_normalised"]

NUM = (int, float)


class MarginKey(NamedTuple):
    """A `Loss` config key that margins read: accepted type(s), default, one-line help and its
    rule (keyword arguments of `plsc.config.Key`: a range)."""
    types: tuple
    default: object
    help: str
    rule: dict = {}


# In the order the config lists them (and writes them back).
MARGIN_KEYS = {
    "scale": MarginKey(NUM, 64.0, "logit scale s", {"above": 0}),
    "m1": MarginKey(NUM, 1.0, "multiplicative angular margin (combined, sphereface)"),
    "m2": MarginKey(NUM, 0.5, "additive angular margin (combined, arcface)"),
    "m3": MarginKey(NUM, 0.0, "additive cosine margin (combined, cosface)"),
    "straight_through": MarginKey((bool,), False,
                                  "insightface's margin gradient instead of the exact one"),
    "adaface_m": MarginKey(NUM, 0.4, "AdaFace margin m"),
    "adaface_h": MarginKey(NUM, 0.333, "AdaFace h: how far the feature norm moves the margin"),
    "adaface_t_alpha": MarginKey(NUM, 0.01, "AdaFace momentum of the running norm statistics",
                                 {"low": 0, "high": 1}),
}


class MarginRow(NamedTuple):
    """One margin. `args`: constructor argument -> the `MARGIN_KEYS` key whose value it takes.
    `loss_type`: None, or the (scale, m1, m2, m3) of PLSC's loss type of this name (also
    "dist_" + name), which `Entry.set_loss_type` writes."""
    name: str
    class_name: str
    normalized: bool
    args: dict
    loss_type: Optional[tuple] = None


MARGIN_TABLE = (
    MarginRow("arcface", "ArcFace", True,
              {"s": "scale", "m": "m2", "straight_through": "straight_through"},
              loss_type=(64.0, 1.0, 0.5, 0.0)),
    MarginRow("cosface", "CosFace", True, {"s": "scale", "m": "m3"},
              loss_type=(64.0, 1.0, 0.0, 0.4)),
    MarginRow("sphereface", "SphereFace", True,
              {"s": "scale", "m": "m1", "straight_through": "straight_through"}),
    MarginRow("combined", "CombinedMargin", True,
              {"s": "scale", "m1": "m1", "m2": "m2", "m3": "m3",
               "straight_through": "straight_through"}),
    MarginRow("adaface", "AdaFace", True,
              {"s": "scale", "m": "adaface_m", "h": "adaface_h", "t_alpha": "adaface_t_alpha"}),
    MarginRow("softmax", "Softmax", False, {}, loss_type=(1.0, 1.0, 0.0, 0.0)),
)
"""Every margin, one `MarginRow` each, in the order the config's help lists them."""
DEFAULT_MARGIN = "arcface"


def margin_names(normalized=None):
    """The margins' names in table order (only the normalised ones, or only the others)."""
    return tuple(r.name for r in MARGIN_TABLE if normalized in (None, r.normalized))


def either(names):
    """'a, b or c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def margin_row(name=None, class_name=None):
    """The row of the margin called `name` (or whose class is called `class_name`);
    ValueError naming the allowed values otherwise."""
    for row in MARGIN_TABLE:
        if (name is not None and row.name == name) or \
                (class_name is not None and row.class_name == class_name):
            return row
    if name is not None:
        raise ValueError(f"unknown margin {name!r}; expected one of {either(margin_names())}")
    raise ValueError(f"{class_name} is no margin of the table; its classes: "
                     f"{either([r.class_name for r in MARGIN_TABLE])}")


def margin_kwargs(loss):
    """(name, constructor keyword arguments) of the margin a validated `Loss` section asks
    for: each argument from its key, numbers as floats."""
    row = margin_row(loss["margin"])
    return row.name, {arg: float(loss[key]) if MARGIN_KEYS[key].types == NUM else loss[key]
                      for arg, key in row.args.items()}


def loss_types():
    """PLSC's loss types -> (margin, scale, m1, m2, m3). The dist_ and plain variants are the
    same here: every head is class-sharded, and one rank is simply a world of size one."""
    types = {}
    for row in MARGIN_TABLE:
        if row.loss_type is not None:
            for name in (f"dist_{row.name}", row.name):
                types[name] = (row.name,) + row.loss_type
    return types


def cosine_options(sub_centers=1, interclass_filtering_threshold=0.0):
    """The options set that only a normalised margin (cosine logits) serves, each as (name,
    value, why): sub-centres (a cosine per centre) and inter-class filtering (it filters
    cosines). The config, `PartialFC` and the softmax refuse them with any other margin."""
    found = []
    if sub_centers > 1:
        found.append(("sub_centers", sub_centers, "a cosine per centre"))
    if interclass_filtering_threshold > 0:  # as arcface_torch: above 0 is on
        found.append(("interclass_filtering_threshold", interclass_filtering_threshold,
                      "it filters cosines"))
    return found


def check_normalised(margin, sub_centers=1, interclass_filtering_threshold=0.0):
    """ValueError naming the first of `cosine_options` set when `margin` (a `Margin`) is not
    normalised."""
    if not margin.normalized:
        for name, value, why in cosine_options(sub_centers, interclass_filtering_threshold):
            raise ValueError(f"{name}={value} needs a normalised margin ({why}), not {margin}")
