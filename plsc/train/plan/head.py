"""The head's memory per rank, from plsc's own head and storage code.

Bytes per class: a head of a few classes is built as the trainer builds it (`PartialFC` with the
config's margin, storage dtype and sub-centres, its optimizer from `build_head_optimizer`, the
state created by `init_state`) and `plsc.storage.nbytes` of each array is divided by its
classes, so every storage's figure (8-bit codes and row scales, 4-bit codes and block scales,
AdamW's step counts) is the storage's own. Workspaces: the step's buffers as the head and its
optimizer size them (`PartialFC._chunk_for`, the sampled rows in their storage or as float32, the
slab budgets, the optimizer's chunk of rows bounded by the rows it updates), and on the separate
update path (gradient accumulation, `fused_head_update: false`, a float16 loss scale) the
gradient arrays `SparseRowOptimizer._apply` and `_gradients` make: the upcast of a 16-bit
gradient, the loss scale's product, the merge of the micro-batches' Partial FC rows.
"""
import math
from dataclasses import dataclass, field

from ... import storage
from ...nn import PartialFC
from ...nn.parallel_softmax import _DEVICE_WGRAD_BYTES, wgrad_block_bytes
from ...optim.sparse_rows import _CHUNK
from ..builders import build_head_optimizer, build_margin_from_config

__all__ = ["HeadShape", "head_arrays_per_class", "head_shape", "head_workspace"]

_PROBE_CLASSES = 8  # classes of the head built to read the arrays' bytes


def _probe_head(cfg, classes=_PROBE_CLASSES):
    loss, m = cfg["Loss"], cfg["Model"]
    chunk = "auto" if loss["chunk_size"] is None else loss["chunk_size"]
    return PartialFC(m["embedding_size"], classes, build_margin_from_config(loss),
                     sample_ratio=loss["sample_ratio"], chunk_size=chunk,
                     logits_budget=int(loss["logits_budget_mb"] * (1 << 20)),
                     param_dtype=loss["param_dtype"], sub_centers=loss["sub_centers"],
                     interclass_filtering_threshold=loss["interclass_filtering_threshold"],
                     check_inputs="labels", group=None)


def head_arrays_per_class(cfg):
    """{array name: bytes per class} of the head's arrays kept between steps: "centres",
    "bias" (margins without normalisation) and each optimizer state array ("velocity",
    "moment1", "moment2", "steps"), stored as the config asks."""
    head = _probe_head(cfg)
    opt = build_head_optimizer(cfg, 0.1)
    out = {"centres": storage.nbytes(head.weight) / _PROBE_CLASSES}
    if head.bias is not None:
        out["bias"] = storage.nbytes(head.bias) / _PROBE_CLASSES
    for name, array in opt.init_state(head).items():
        if name != "step_count":
            param, key = name.rsplit(".", 1)
            label = key if param == "weight" else f"bias {key}"
            out[label] = storage.nbytes(array) / _PROBE_CLASSES
    return out


@dataclass
class HeadShape:
    """What one rank's head works on in a step."""
    num_local: int  # classes this rank owns (the largest shard)
    rows_used: int  # classes in the step's GEMMs (all, or Partial FC's sampled ones)
    n: int  # gathered batch N
    d: int
    k: int  # centres per class
    chunk: int  # classes per block (0: dense)
    fused: bool  # the update inside the backward
    stored_rows: bool  # Partial FC's rows gathered in their storage (no float32 copy)
    row_bytes: float  # bytes of one class's centres as stored
    per_class_logit: int = 4  # bytes of a class's logits per sample
    micro: int = 1  # micro-batches a step (Optimizer.accumulate_steps)
    float16_amp: bool = False  # float16 AMP: on a GPU a loss scale multiplies the gradients
    notes: list = field(default_factory=list)


def head_shape(cfg, ranks, fused, probe=None):
    """The largest shard's `HeadShape` for `ranks` ranks (`fused`: the trainer updates the
    head inside its backward)."""
    from ...distributed import ClassPartition
    loss = cfg["Loss"]
    probe = probe or _probe_head(cfg)
    part = ClassPartition(loss["num_classes"], ranks)
    num_local = part.num_local(0)
    n = cfg["Data"]["batch_size"] * ranks
    ratio = loss["sample_ratio"]
    # Partial FC: max(int(ratio·C_local), positives); a shard's distinct positives expected
    # from uniformly spread labels (N·C_local/C; at most N, where the labels are so few)
    positives = -(-n * num_local // loss["num_classes"])
    rows_used = num_local if ratio >= 1.0 else min(num_local, max(int(ratio * num_local),
                                                                  positives))
    k = loss["sub_centers"]
    chunk = probe._chunk_for(n, rows_used * k) or 0  # the head's own choice
    if chunk and chunk * k >= rows_used * k:
        chunk = 0  # one block holding every class is the dense path
    row_bytes = storage.nbytes(probe.weight) / _PROBE_CLASSES
    stored = ratio < 1.0 and fused and loss["param_dtype"] != "float32"
    per_logit = 4 * (1 if k == 1 else k + 2)
    amp = cfg["AMP"]
    return HeadShape(num_local, rows_used, n, cfg["Model"]["embedding_size"], k, chunk, fused,
                     stored, row_bytes, per_logit, cfg["Optimizer"]["accumulate_steps"],
                     amp["enable"] and amp["dtype"] == "float16")


# float32 copies of a chunk's rows an update holds at once (the rows read, the state read, the
# gradient's terms, the new values): the optimizers' `_update`, an estimate.
_UPDATE_COPIES = 4


def head_workspace(s, device):
    """{buffer: bytes} of one step's head buffers on rank `s` (a `HeadShape`); `device`: the
    device kernel set (a GPU), else the CPU set."""
    d, k = s.d, s.k
    out = {"features and their gradient": 3 * 4 * s.n * d}
    width = s.chunk or s.rows_used
    out["logits" if not s.chunk else "logits block"] = s.n * width * s.per_class_logit
    out["inverse centre norms"] = 4 * s.rows_used * k
    pfc = s.rows_used < s.num_local
    if pfc:  # Partial FC's gathered rows (their gradient written over them), one set a
        # micro-batch: the optimizer keeps each micro-batch's rows until the step (`stash`)
        out["sampled rows"] = s.micro * s.rows_used * (s.row_bytes if s.stored_rows else 4 * d * k)
    narrow = s.row_bytes < 4 * d * k or s.stored_rows
    # the head's weight is float32 when stored so, or as Partial FC's float32 copy of its rows
    float32 = s.row_bytes >= 4 * d * k or (pfc and not s.stored_rows)
    wgrad = _DEVICE_WGRAD_BYTES if device else wgrad_block_bytes(float32)
    if narrow:  # a block's rows read as float32, a slab at a time beyond the budget
        out["float32 rows of a block"] = min(wgrad, 4 * d * k * width)
    out["weight gradient slab"] = min(wgrad, 4 * d * k * width)
    # rows one update walks (the shard's, Partial FC's sampled ones merged over micro-batches),
    # a chunk at a time (`SparseRowOptimizer._apply`: `_CHUNK` rows, or a device slab)
    updated = k * _merged_rows(s)
    chunk = storage.slab_rows(d, budget=storage.DEVICE_SLAB_BYTES) if device else _CHUNK
    out["update chunk temporaries"] = _UPDATE_COPIES * 4 * d * min(chunk, updated)
    if not s.fused:
        out.update(_separate_update(s, device, updated))
    return out


def _merged_rows(s):
    """Distinct classes the step's micro-batches sampled: each samples anew (a fraction r of
    the shard), so about 1 - (1 - r)^micro of the shard; all of it without Partial FC."""
    if s.micro == 1 or s.rows_used >= s.num_local:
        return s.rows_used
    return max(s.rows_used, math.ceil(s.num_local * (1 - (1 - s.rows_used / s.num_local)
                                                        ** s.micro)))


def _separate_update(s, device, updated):
    """The gradient arrays of an update after the backward (`SparseRowOptimizer.step`)."""
    d, k = s.d, s.k
    out = {}
    if device and s.float16_amp:  # `_apply`'s `grad * grad_scale`, float32
        out["gradient times the loss scale"] = 4 * d * updated
    if s.rows_used < s.num_local:
        if s.micro > 1:  # `_gradients`: the parts concatenated, then summed per unique row
            out["micro-batches' sampled rows, concatenated and merged"] = (
                4 * d * k * s.micro * s.rows_used + 4 * d * updated)
        return out
    sixteen = s.row_bytes == 2 * d * k  # autograd's gradient is 16-bit; an 8-bit weight's
    per_value = 2 if sixteen else 4  # is float32 (`PartialFC._keep_dense_gradient`)
    out["weight gradient"] = per_value * d * k * s.num_local
    # `_apply` upcasts a 16-bit gradient whole (`to_float32`), after the backward; with
    # micro-batches an autograd weight's next gradient comes beside the sum in the backward.
    # Not alive at once, but both counted: the blocks one frees stay in the process (malloc,
    # a device's caching allocator) when the other is allocated, and are not of its size
    # (a run: IResNetTiny, 600K bfloat16 classes, AdamW, 2 micro-batches, 3 ranks: the larger
    # of the two predicted 8.9 % under the measured peak, both within 1 %)
    if sixteen:
        out["weight gradient, float32 upcast for the update"] = 4 * d * k * s.num_local
    if s.micro > 1 and s.row_bytes >= 2 * d * k:
        out["next micro-batch's weight gradient"] = per_value * d * k * s.num_local
    return out
