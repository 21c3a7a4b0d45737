"""PartialFC: the class-sharded classification head."""
import math
import numbers

import paddle
from paddle import nn

from ..distributed import ClassPartition, all_gather, gather_concat, group_rank_size
from ..kernels.cpu_kernels import take_rows
from ..kernels.numerics import SLAB_BYTES
from ..process import cpu_setup
from .. import storage
from ..storage import HEAD_DTYPES, take as take_f32
from ..loss import ArcFace, Margin
from ..loss.table import check_normalised
from .parallel_softmax import parallel_softmax_cross_entropy
from .sampling import sample_centres
from .workspace import Workspace

__all__ = ["PartialFC"]


class PartialFC(nn.Layer):
    """Margin-softmax head whose classes are split across the ranks of `group`.

    `loss = head(local_embeddings, local_labels)` is the mean loss over the
    global batch (all ranks' samples), the same value on every rank, and the
    gradients of `local_embeddings`, `head.weight` (and `head.bias`) are its
    exact partial derivatives.

    Args:
        embedding_size: d, the width of the embeddings.
        num_classes: C, the total number of classes across ranks.
        margin: a `plsc.loss.Margin` (default `ArcFace()`); `Softmax()` adds a bias.
        sample_ratio: Partial FC. Below 1, each step uses every class centre that
            is a positive of the global batch plus uniformly drawn negatives, up to
            `max(int(sample_ratio * num_local), #positives)` per rank. Gradients then
            exist only for those rows, in `head.sampled_weight.grad` (and
            `head.sampled_bias.grad`; the weight's gradient is written over the gathered
            rows, whose values are gone after the backward), and `plsc.optim.SparseMomentum` /
            `SparseAdamW` apply them to `head.weight` (a plain Paddle optimizer
            would see no gradient on `head.weight`). With `row_update` a 16- or 8-bit
            weight's rows are gathered in their storage (no float32 copy, no gradient).
        seed: seed of the sampling draw, which depends on (seed, step, rank);
            the step counter `head.sample_step` is a buffer saved with the state.
        chunk_size: "auto" (default): the dense path while this rank's
            `[N, num_sample]` float32 logits fit in `logits_budget` bytes, else
            blocks of `logits_budget // (4·N)` classes; an int: always blocks of
            that many classes (the logits never exist whole); 0: always dense.
        logits_budget: bytes the logits may take with chunk_size="auto" (2 GiB).
        reuse_buffers: keep the step's largest buffers (the logits or a block of them,
            the gathered rows of Partial FC) in `head.workspace` and write the next
            step into them, instead of allocating them anew (see `plsc.nn.workspace`).
            They are alive at the step's peak anyway; between steps they stay
            allocated (`head.workspace.nbytes`; `head.workspace.clear()` frees them).
        param_dtype: storage dtype of `weight` (and `bias`): "float32" (default), "bfloat16"
            or "float16"; or "int8": `weight` is a `plsc.storage.int8.Int8Rows` (a byte per value
            and a float32 scale per row, a quarter of float32's bytes; `bias` stays float32), whose
            gradient goes to `row_update` or, without one, to `row_gradient("weight")`; it is no
            Paddle parameter, so `state_dict()` leaves it out (plsc's checkpoints save it). Every
            GEMM reads a block of rows as float32 and every softmax statistic is float32; only
            storage is narrower.
        sub_centers: K centres per class (sub-center ArcFace; normalised margins only):
            `weight` is `[num_local·K, d]`, local class j's centres are rows j·K … j·K + K − 1,
            and a class's cosine is the largest of its centres'. Partial FC samples classes
            (`sampled_index`), each bringing its K rows (`sampled_rows`).
        interclass_filtering_threshold: t, arcface_torch's inter-class filtering for noisy
            data (normalised margins only; 0, the default, is off). Each step, every
            non-target class whose cosine with a sample is above t (float32, as arcface_torch
            compares; with sub-centres the class's cosine, the largest of its K) gets logit 0
            for that sample, before the margin and the scale: it stays in the softmax's sum
            as exp(0 − max) but passes no gradient. A sample's own class is never filtered.
            With Partial FC it applies to the sampled classes (the only ones with logits).
        group: process group that shares the classes (default: the world).
        init_std: standard deviation of the normal initialisation of the centres.
        check_inputs: True: validate labels and batch sizes across ranks every step
            (one tiny all-gather and one host read), so that bad input raises on
            every rank before any other collective. "labels": no read in the step
            (batch sizes are the caller's promise, e.g. a drop_last sampler); labels
            outside [0, num_classes) are left out of the step and
            `head.loss_value(loss)` raises for them as it reads the loss. False: neither.

    `head.row_update`: None, or a callable that the backward hands each slab of the step's
    weight (and bias) gradient rows to, e.g. `SparseMomentum.fused_update(head)`: the
    optimizer update then happens inside the backward and no weight gradient exists.
    """

    def __init__(self, embedding_size, num_classes, margin=None, sample_ratio=1.0, seed=0,
                 group=None, init_std=0.01, check_inputs=True, chunk_size="auto",
                 logits_budget=2 << 30, reuse_buffers=True, param_dtype="float32",
                 sub_centers=1, interclass_filtering_threshold=0.0):
        super().__init__()
        cpu_setup.ensure()  # a run's CPU set-up (threads, malloc) unless the user chose
        margin = ArcFace() if margin is None else margin
        _check_arguments(margin, embedding_size, sample_ratio, chunk_size, logits_budget,
                         check_inputs, param_dtype, sub_centers, interclass_filtering_threshold)
        self.embedding_size = int(embedding_size)
        self.num_classes = int(num_classes)
        self.margin = margin
        self.sample_ratio = float(sample_ratio)
        self.seed = int(seed)
        self.chunk_size, self.logits_budget = chunk_size, int(logits_budget)
        self.group = group
        self.workspace = Workspace(reuse_buffers)
        self.check_inputs = check_inputs
        self.rank, self.world_size = group_rank_size(group)
        self.partition = ClassPartition(self.num_classes, self.world_size)
        self.class_start = self.partition.class_start(self.rank)
        self.num_local = self.partition.num_local(self.rank)
        self.param_dtype = param_dtype
        self.sub_centers = sub_centers
        self.interclass_filtering_threshold = float(interclass_filtering_threshold)
        self._create_parameters(init_std)
        # The sampling step counter lives on the host, so reading it never waits for a device.
        self.register_buffer("sample_step", paddle.zeros([], dtype="int64").cpu())
        self.sample_loss = None
        # The centres of the last step: indices into this rank's classes (None: all), the
        # weight rows they own (`sub_centers` per class), and those rows gathered.
        self.sampled_index = self.sampled_rows = self.sampled_weight = self.sampled_bias = None
        self._last_target = self._bad_labels = self._global_labels = None
        self.row_update = None
        self._dense_grads = {}  # an 8-bit weight's gradient (and the bias's) without row_update

    def _create_parameters(self, init_std):
        """`weight`, K rows per local class drawn from N(0, init_std²), and for a margin that
        is not normalised `bias`, zeros (float32 for an 8-bit weight: one value per row)."""
        self.weight = _normal_parameter(self, [self.num_local * self.sub_centers,
                                               self.embedding_size], init_std, self.param_dtype)
        self.bias = None
        if not self.margin.normalized:
            bias_dtype = "float32" if self.param_dtype == "int8" else self.param_dtype
            self.bias = self.create_parameter([self.num_local], dtype=bias_dtype, is_bias=True,
                                              default_initializer=nn.initializer.Constant(0.0))

    def forward(self, embeddings, labels):
        """The mean loss over the global batch (the same value on every rank) of this rank's
        `embeddings` `[b, d]` and int `labels` `[b]` (global class indices); each sample's
        loss is kept in `head.sample_loss` (this rank's `[b]`, detached)."""
        labels = self._check_local(embeddings, labels)
        if self.check_inputs is True:
            self._check_across_ranks(labels)
        global_labels = gather_concat(labels, self.group)
        # Labels outside [0, C) (possible with check_inputs "labels" or False) belong to no rank.
        safe, self._bad_labels = self._clipped(global_labels)  # bad ones: -1 below anyway
        self._global_labels = global_labels
        local_target = paddle.where(self._bad_labels, paddle.full_like(global_labels, -1),
                                    self.partition.shard_labels(safe, self.rank))
        weight, bias, local_target = self._select_centres(local_target)
        if embeddings.dtype != paddle.float32:
            embeddings = embeddings.astype("float32")
        features = all_gather(embeddings, self.group)
        self.last_chunk_size = self._chunk_for(features.shape[0], weight.shape[0])
        row_update = self.row_update
        if row_update is None and not storage.has_autograd(weight):
            row_update = self._keep_dense_gradient  # autograd has no 8-bit gradient
        losses = parallel_softmax_cross_entropy(
            features, weight, bias, local_target, self.margin, self.group, self.last_chunk_size,
            self.workspace, grad_into_weight=weight is self.sampled_weight,
            row_update=row_update, sub_centers=self.sub_centers,
            interclass_filtering_threshold=self.interclass_filtering_threshold)
        b = labels.shape[0]
        self.sample_loss = losses[self.rank * b:(self.rank + 1) * b].detach()
        return losses.mean()

    def _chunk_for(self, n, num_rows):
        """Classes per block for a step over `num_rows` weight rows (None: dense). A class's
        logits take 4·N bytes; with K sub-centres also its K cosines and the winner's index."""
        if self.chunk_size == "auto":
            k = self.sub_centers
            per_class = 4 * n * (1 if k == 1 else k + 2)
            if per_class * (num_rows // k) <= self.logits_budget:
                return None
            return max(1, self.logits_budget // per_class)
        return self.chunk_size or None

    def _select_centres(self, local_target):
        """The class centres that take part in this step, and labels indexing them."""
        if self.sample_ratio >= 1.0:
            self._last_target = local_target
            return self.weight, self.bias, local_target
        step = int(self.sample_step)  # a host tensor: no device read
        index, target = sample_centres(local_target, self.num_local, self.sample_ratio,
                                       self.seed, step, self.rank)
        if self.training:
            self.sample_step.fill_(step + 1)
        # Gathered from a detached weight, so the gradient is [num_sample, d], never [num_local, d].
        self.sampled_index, self.sampled_rows = index, _rows_of(index, self.sub_centers)
        if self.row_update is not None and not storage.is_float32(self.weight):
            # No gradient array to write over: the rows stay in their storage, read as float32
            # a block at a time by the GEMMs (a quarter of float32's bytes for int8).
            source = self.weight.detach() if storage.has_autograd(self.weight) else self.weight
            self.sampled_weight = storage.take_stored(source, self.sampled_rows)
            self.sampled_weight.stop_gradient = self.weight.stop_gradient
        else:
            self.sampled_weight = self._gather_rows("rows", self.weight, self.sampled_rows)
        self.sampled_bias = self._gather_rows("bias_rows", self.bias, index) \
            if self.bias is not None else None
        self._last_target = target
        return self.sampled_weight, self.sampled_bias, target

    def _gather_rows(self, name, param, index):
        """Rows `index` of `param`, float32, as a new leaf (written into a lent buffer when
        there is one), so the gradient is `[num_sample, ...]`, never the whole shard's. 16-bit
        rows are gathered and upcast a slab at a time into the float32 rows (`storage.slab_rows`:
        the budget of the kernel set serving them)."""
        shape = [index.shape[0]] + list(param.shape[1:])
        out = self.workspace.lend(name, shape, self, "float32")
        source = param.detach() if storage.has_autograd(param) else param
        rows = out.detach() if out is not None else None  # a new leaf over the buffer
        if storage.is_float32(source):
            rows = take_rows(source, index, out=rows)
        else:
            rows = rows if rows is not None else paddle.empty(shape, dtype="float32")
            step = storage.slab_rows(math.prod(shape[1:]), index)
            for lo in range(0, shape[0], step):
                part = index[lo:lo + step]
                rows[lo:lo + part.shape[0]] = take_f32(source, part)
        rows.stop_gradient = param.stop_gradient
        return rows

    def _keep_dense_gradient(self, lo, hi, weight_grad, bias_grad):
        """The backward's sink for an 8-bit weight without `row_update`: its gradient rows (and
        the bias's) are added to float32 arrays the optimizer reads (`row_gradient`), summed
        over the backwards until `drop_dense_gradients`, as Paddle sums a parameter's."""
        for name, grad, param in (("weight", weight_grad, self.weight),
                                  ("bias", bias_grad, self.bias)):
            if grad is not None:
                if name not in self._dense_grads:
                    self._dense_grads[name] = paddle.zeros(param.shape, dtype="float32")
                self._dense_grads[name][lo:hi] += grad

    def row_gradient(self, name):
        """The gradient of "weight" or "bias" that the backwards since the optimizer's last step
        left (float32 or the storage dtype), or None: of the rows `sampled_rows` /
        `sampled_index` with Partial FC, of every row otherwise."""
        if self.sampled_index is not None:
            rows = self.sampled_weight if name == "weight" else self.sampled_bias
            return getattr(rows, "grad", None)  # (none for rows kept in their storage)
        if name in self._dense_grads:
            return self._dense_grads[name]
        param = self.weight if name == "weight" else self.bias
        return param.grad if storage.has_autograd(param) else None

    def drop_dense_gradients(self):
        """Free the gradients of the whole weight and bias (an optimizer step used them)."""
        self._dense_grads = {}
        for param in (self.weight, self.bias):
            if isinstance(param, paddle.Tensor):  # (clear_gradient(set_to_zero=False) does not
                param.grad = None  # free it in Paddle 3.3; this does)

    def release_sampled_rows(self, gradients_kept=False):
        """Drop the last step's gathered rows and their gradients (the optimizer applied them).
        `gradients_kept`: the caller keeps the gradients (gradient accumulation), so their
        memory (the weight's is the gathered rows' own) is not lent to the next step."""
        # Each step's rows are a new leaf over the lent buffer, so no gradient carries over;
        # do not clear `.grad` here: it shares the buffer's storage and clearing it frees that.
        self.sampled_weight = self.sampled_bias = None
        if not gradients_kept:
            self.workspace.give_back("rows")
            self.workspace.give_back("bias_rows")

    @property
    def num_sample(self):
        """Class centres this rank used in the last step."""
        return self.num_local if self.sampled_index is None else int(self.sampled_index.shape[0])

    @property
    def num_positive(self):
        """Distinct positives of the last global batch among this rank's classes."""
        if self._last_target is None or self._last_target.shape[0] == 0:
            return 0
        # Fixed shapes (no unique / masked_select): sorted, a label counts where it starts a
        # run; labels owned elsewhere (-1) sort first and are not counted. One read.
        t = paddle.sort(self._last_target)
        starts = paddle.concat([t[:1] >= 0, paddle.logical_and(t[1:] != t[:-1], t[1:] >= 0)])
        return int(starts.astype("int64").sum())

    @property
    def positive_fraction(self):
        """Share of the last step's centres on this rank that were positives."""
        return self.num_positive / self.num_sample

    def _check_local(self, embeddings, labels):
        if embeddings.ndim != 2 or embeddings.shape[1] != self.embedding_size:
            raise ValueError(f"embeddings must have shape [batch, {self.embedding_size}], "
                             f"got {list(embeddings.shape)}")
        if labels.dtype not in (paddle.int32, paddle.int64):
            raise TypeError(f"labels must be int32 or int64, got {labels.dtype}")
        labels = labels if labels.ndim == 1 else labels.reshape([-1])
        labels = labels if labels.dtype == paddle.int64 else labels.astype("int64")
        if labels.shape[0] != embeddings.shape[0]:
            raise ValueError(f"got {labels.shape[0]} labels for {embeddings.shape[0]} embeddings")
        return labels

    def loss_value(self, loss, finite=None):
        """`float(loss)` of the last forward, read together with the label check in one host
        read; raises ValueError (the same on every rank) if a label was outside [0, C). With
        `finite`, a 0-d bool tensor (e.g. whether the step's gradients are finite), that is
        read in the same read and `(loss, finite and the loss is finite)` is returned."""
        read = self.read_loss_checks([self.loss_check(loss)], finite)
        return read[0] if finite is None else (read[0][0], read[1])

    def loss_check(self, loss):
        """`loss` of the last forward and its label check as a float64 `[4]` tensor left on the
        device: (loss, bad labels in the global batch, the first one's position, its value)."""
        bad = self._bad_labels.astype("int64")
        first = paddle.argmax(bad)
        return paddle.stack([loss.reshape([]).astype("float64"), bad.sum().astype("float64"),
                             first.astype("float64"),
                             self._global_labels[first].astype("float64")])

    def read_loss_checks(self, checks, finite=None):
        """One host read of `loss_check`s (of micro-batches of the same size, in order) and of
        `finite` (0-d bool tensor or None); raises ValueError, the same on every rank, for the
        first bad label. Returns the losses (floats), or `(losses, finite and every loss is
        finite)` with `finite`."""
        parts = list(checks)
        if finite is not None:
            parts.append(finite.reshape([1]).astype("float64"))
        packed = paddle.concat(parts).numpy()
        per_rank = self._global_labels.shape[0] // self.world_size
        for i in range(len(checks)):
            _, count, first, value = packed[4 * i:4 * i + 4]
            if count:
                _raise_bad_label(int(value), int(first) // per_rank, int(count),
                                 self.num_classes, "the global batch")
        losses = [float(v) for v in packed[0:4 * len(checks):4]]
        if finite is None:
            return losses
        return losses, bool(packed[-1]) and all(math.isfinite(v) for v in losses)

    def _clipped(self, labels):
        """(labels clipped into [0, C), where they were outside it): one op for each, no
        data-dependent shape."""
        safe = labels.clip(0, self.num_classes - 1)
        return safe, safe != labels

    def _check_across_ranks(self, labels):
        """Every rank learns every rank's batch size and first bad label, then all raise alike."""
        bad = self._clipped(labels)[1].astype("int64")
        info = paddle.stack([paddle.full([], labels.shape[0], "int64"), bad.sum(),
                             labels[paddle.argmax(bad)]])
        table = gather_concat(info, self.group).reshape([-1, 3]).numpy()  # the one read
        for rank, (_, count, value) in enumerate(table):
            if count:
                _raise_bad_label(value, rank, count, self.num_classes, "that rank's batch")
        sizes = table[:, 0].tolist()
        if len(set(sizes)) > 1:
            raise ValueError(f"local batch sizes differ across ranks: {sizes}; PartialFC needs the "
                             "same batch size on every rank (use drop_last=True in the sampler)")

    def extra_repr(self):
        """The head's sizes and options, as `repr(head)` shows them."""
        return (f"embedding_size={self.embedding_size}, num_classes={self.num_classes}, "
                f"class_start={self.class_start}, num_local={self.num_local}, "
                f"margin={self.margin}, sample_ratio={self.sample_ratio}, chunk_size={self.chunk_size}"
                + (f", sub_centers={self.sub_centers}" if self.sub_centers > 1 else "")
                + (f", interclass_filtering_threshold={self.interclass_filtering_threshold}"
                   if self.interclass_filtering_threshold else ""))


def _check_arguments(margin, embedding_size, sample_ratio, chunk_size, logits_budget,
                     check_inputs, param_dtype, sub_centers, threshold):
    """ValueError (TypeError for a margin that is none) naming the first bad argument of
    `PartialFC`; the options that need a normalised margin are refused by the margins' one
    rule (`plsc.loss.table.check_normalised`)."""
    if not isinstance(margin, Margin):
        raise TypeError(f"margin must be a plsc.loss.Margin, got {type(margin).__name__}")
    if int(embedding_size) < 1:
        raise ValueError(f"embedding_size must be >= 1, got {embedding_size}")
    if not 0.0 < float(sample_ratio) <= 1.0:
        raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio}")
    if chunk_size != "auto" and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                 or chunk_size < 0):
        raise ValueError(f"chunk_size must be 'auto', 0 (dense) or a positive int, got {chunk_size!r}")
    if int(logits_budget) < 1:
        raise ValueError(f"logits_budget must be a positive number of bytes, got {logits_budget!r}")
    if check_inputs not in (True, False, "labels"):
        raise ValueError(f"check_inputs must be True, False or 'labels', got {check_inputs!r}")
    if param_dtype not in HEAD_DTYPES:
        raise ValueError(f"param_dtype must be one of float32, bfloat16, float16 or int8, "
                         f"got {param_dtype!r}")
    if isinstance(sub_centers, bool) or not isinstance(sub_centers, int) or sub_centers < 1:
        raise ValueError(f"sub_centers must be a positive int, got {sub_centers!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) \
            or not 0.0 <= threshold <= 1.0:
        raise ValueError(f"interclass_filtering_threshold must be a number in [0, 1] (0: off), "
                         f"got {threshold!r}")
    check_normalised(margin, sub_centers, threshold)


def _normal_parameter(layer, shape, std, dtype):
    """A parameter of `dtype` drawn from N(0, std²): float32 draws made a slab of rows at a
    time (the same numbers as one draw of the whole shape) and, for 16- and 8-bit storage,
    rounded to nearest, so no whole float32 copy of a narrower parameter ever exists. int8: an
    `Int8Rows`, not a Paddle parameter."""
    init = nn.initializer.Normal(0.0, std)
    if dtype == "float32":
        return layer.create_parameter(shape, dtype="float32", default_initializer=init)
    if dtype == "int8":
        param = storage.zeros(shape, "int8")
    else:
        param = layer.create_parameter(shape, dtype=dtype,
                                       default_initializer=nn.initializer.Constant(0.0))
    step = max(1, SLAB_BYTES // (4 * shape[1]))
    with paddle.no_grad():
        for lo in range(0, shape[0], step):
            rows = min(step, shape[0] - lo)
            storage.put(param, lo, paddle.normal(0.0, std, [rows, shape[1]]))  # to nearest
    return param


def _rows_of(classes, k):
    """The weight rows of `classes` with K centres per class (class-major)."""
    if k == 1:
        return classes
    return (classes.unsqueeze(1) * k + paddle.arange(k, dtype="int64")).reshape([-1])


def _raise_bad_label(value, rank, count, num_classes, where):
    raise ValueError(f"label {value} on rank {rank} is outside [0, {num_classes}) "
                     f"({count} bad label(s) in {where})")
