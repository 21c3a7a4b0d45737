"""Optimizers for the head that touch only the rows a step used.

With Partial FC a step has gradients for the sampled class centres only.
These optimizers update those rows of `head.weight` (and `head.bias`) and of
their optimizer state, and nothing else: rows that were not sampled keep
their values and their momentum bit for bit, and weight decay applies to the
sampled rows only. At `sample_ratio = 1` every row is "sampled" and the
update is the ordinary dense one.

The formulas are Paddle's: `Momentum` with L2 weight decay added to the
gradient, and `AdamW` with decoupled decay.

Storage is not compute: the weight and the optimizer state may be stored in
bfloat16, float16 or 8 bits per value with a scale per row (`plsc.storage.int8`). Each
chunk's rows are read as float32, updated in float32, and written back rounded to
their storage (`plsc.optim.rounding`; stochastically by default, with random bits
that depend on the optimizer's own step count, the head's rank and the row, so a
resumed run is bit-identical); an 8-bit row gets a new scale when it is written.
8-bit state uses the map `int8_maps` names for it (AdamW's moments are
logarithmic, see `plsc.storage.int8`), 4-bit state (`state_dtype="int4"`, two codes a byte and a
scale per block, `plsc.storage.int4`) the map `int4_maps` names; state with one value per row
(the bias's, AdamW's step counts) stays float32. Gradients may come in any float dtype and are upcast.
Float32 storage is neither rounded nor changed in any bit.

Kernel sets (`plsc.kernels.cpu_kernels.cpu_set`): the CPU set updates chunks of 1,024 rows and reads
the fused update's finiteness on the host; the device set updates a slab from
`plsc.storage`'s byte budget at a time, keeps the finiteness on the device (a slab whose
gradient is not finite writes its rows back as they were) and merges accumulated gradients
by a stable sort instead of `unique`: no host read, no data-dependent shape. Both run the same
float32 operations on each row, so they give the same bits.
"""
import math

import paddle

from ..process import cpu_setup
from .. import storage
from ..kernels.cpu_kernels import all_finite, cpu_set, finite_flag
from ..kernels.numerics import sqrt_exact, to_float32
from .step_rows import Rows, head_params, head_rows, merge_sorted, merge_unique, row_index

__all__ = ["SparseRowOptimizer", "SparseMomentum", "SparseAdamW"]

_CHUNK = 1024  # rows updated at a time on the CPU set: temporaries stay cache-sized
# On the device set a slab is `plsc.storage.slab_rows` (its byte budget, 256 MiB of float32
# rows): the update is a fixed number of Paddle ops per slab, whatever the rows.


class SparseRowOptimizer:
    """Base: walks the head's (parameter, rows, gradient rows) and updates them in chunks.

    Args (of every subclass, after its own):
        state_dtype: dtype of the state arrays ("float32", "bfloat16", "float16", "int8" or
            "int4"); None (default): the parameter's.
        rounding: how float32 results are written into 16- and 8-bit arrays: "stochastic"
            (default, unbiased) or "nearest" (to nearest even).
        seed: seed of the stochastic rounding's random bits, which depend on
            (seed, array, `step_count`, `head.rank`, row, column).
    """

    state_names = ()
    int8_maps = {}  # the 8-bit map of each state array (`plsc.storage.int8.INT8_MAPS`)
    int4_maps = {}  # the 4-bit map of each state array (`plsc.storage.int4.INT4_MAPS`)

    def __init__(self, learning_rate, state_dtype=None, rounding="stochastic", seed=0):
        cpu_setup.ensure()  # a run's CPU set-up (threads, malloc) unless the user chose
        if state_dtype is not None and state_dtype not in storage.STATE_DTYPES:
            raise ValueError(f"state_dtype must be None (the parameter's), float32, bfloat16, "
                             f"float16, int8 or int4, got {state_dtype!r}")
        if rounding not in ("stochastic", "nearest"):
            raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
        self.learning_rate = learning_rate
        self.state_dtype, self.rounding, self.seed = state_dtype, rounding, int(seed)
        self.step_count = 0  # steps applied; the rounding's random bits depend on it
        self._rounded = False  # whether a write was rounded: then `step_count` is state
        self._state = {}
        self._stash = {}
        self._fused_counts = [0, 0]  # slabs of the last fused update: applied, skipped (CPU)
        self._fused_flags = []  # 0-d bool tensors, one per slab: its gradient was finite

    @property
    def fused_applied(self):
        """Slabs of the last fused update that were applied (device set: read from it)."""
        return self._fused_counts[0] + sum(bool(f) for f in self._fused_flags)

    @property
    def fused_skipped(self):
        """Slabs of the last fused update whose gradient was not all finite (not applied)."""
        return self._fused_counts[1] + sum(not bool(f) for f in self._fused_flags)

    def fused_finite(self):
        """A 0-d bool tensor: no slab of the last fused update was skipped (nothing read)."""
        if len(self._fused_flags) == 1 and self._fused_counts[1] == 0:
            return self._fused_flags[0]
        flag = paddle.full([], self._fused_counts[1] == 0, dtype="bool")
        for f in self._fused_flags:
            flag = paddle.logical_and(flag, f)
        return flag

    def get_lr(self):
        """The current learning rate (a scheduler's value when `learning_rate` is one)."""
        lr = self.learning_rate
        return float(lr() if callable(lr) else lr)

    def stash(self, head):
        """Keep the sampled rows' gradients of a micro-batch for the next `step`
        (gradient accumulation with Partial FC: each micro-batch samples anew)."""
        for name, _, index, grad in head_rows(head):
            if index is not None and grad is not None:
                self._stash.setdefault(name, []).append((index, grad))
        head.release_sampled_rows(gradients_kept=True)

    def step(self, head, grad_scale=1.0):
        """Apply the gradients of the head's last backward (times `grad_scale`, e.g. the
        inverse loss scale), plus any stashed ones, then release them. With stashed rows
        (Partial FC over micro-batches) malloc's free pages go back first
        (`cpu_setup.release_freed_memory`): the micro-batches' freed blocks are holes the
        merge's large arrays do not fit, kept resident beside them otherwise."""
        lr = self.get_lr()
        if self._stash:
            cpu_setup.release_freed_memory()
        for name, param, index, grad in self._gradients(head):
            self._apply(name, param, head.rank, index, 0, grad, lr, grad_scale)
        head.drop_dense_gradients()
        self._stash = {}
        self.end_fused_step(head)

    def fused_update(self, head, grad_scale=1.0):
        """A `head.row_update` for the next backward: each slab of gradient rows the backward
        produces is applied at once (with this step's learning rate), so no weight gradient
        array exists. The result is `step`'s bit for bit; call `end_fused_step` after the
        backward. Only for steps that are applied whatever happens later: no gradient
        accumulation, no float16 loss-scale check that could skip the step.

        A slab whose gradient is not all finite is not applied (its rows and their state keep
        their bits) and is counted in `fused_skipped`; `fused_applied` counts the others. A
        non-finite loss makes every slab's gradient non-finite, so the head then stays as it
        was (the trainer skips the step, `end_fused_step(head, applied=False)`)."""
        lr = self.get_lr()
        self._fused_counts, self._fused_flags = [0, 0], []

        def update(lo, hi, weight_grad, bias_grad):
            keep = None
            if cpu_set(*[g for g in (weight_grad, bias_grad) if g is not None]):
                if not all_finite(weight_grad, bias_grad):
                    self._fused_counts[1] += 1
                    return
                self._fused_counts[0] += 1
            else:  # decided on the device: a non-finite slab writes its rows as they were
                ok = finite_flag([weight_grad, bias_grad])
                self._fused_flags.append(ok)
                keep = paddle.logical_not(ok)
            for name, param, grad in (("weight", head.weight, weight_grad),
                                      ("bias", head.bias, bias_grad)):
                if grad is not None:
                    self._apply(name, param, head.rank, row_index(head, name), lo, grad, lr,
                                grad_scale, keep)
        return update

    def end_fused_step(self, head, applied=True):
        """Close a step: advance the step count (the rounding bits depend on it) unless nothing
        was `applied`, release the head's gathered rows."""
        self.step_count += 1 if applied else 0
        head.row_update = None  # it holds this step's learning rate
        head.release_sampled_rows()

    def _apply(self, name, param, rank, index, lo, grad, lr, grad_scale, keep=None):
        """Update the step's rows lo .. lo + len(grad) of `param` (rows `index[lo:...]`, or
        those rows themselves when `index` is None) and their state, a chunk (CPU set) or a
        slab (device set) at a time; `keep` (0-d bool tensor): write the rows as they were."""
        state = self._state_for(name, param)
        with paddle.no_grad():
            grad = to_float32(grad)
            if grad_scale != 1.0:
                grad = grad * grad_scale
            hi = lo + grad.shape[0]
            step = _CHUNK if cpu_set(grad) else \
                storage.slab_rows(grad.size // max(1, grad.shape[0]), grad)
            for start in range(lo, hi, step):
                stop = min(start + step, hi)
                rows = Rows(self, name, rank, index, start, stop, keep,
                             dict(state, **{"": param}))
                part = grad if (start, stop) == (lo, hi) else grad[start - lo:stop - lo]
                self._update(param, state, rows, part, lr)
                rows.flush()

    def discard(self, head):
        """Drop the pending gradients without applying them (a skipped step)."""
        self._stash = {}
        head.drop_dense_gradients()
        head.release_sampled_rows()

    def _pending(self, head):
        """(name, parameter, [(row index or None, gradient rows), ...]) awaiting `step`."""
        for name, param, index, grad in head_rows(head):
            parts = list(self._stash.get(name, ()))
            if grad is not None:
                parts.append((index, grad))
            if parts:
                yield name, param, parts

    def _gradients(self, head):
        """(name, parameter, unique sorted row index or None, gradient rows) to apply."""
        for name, param, parts in self._pending(head):
            if len(parts) == 1:  # also the dense case (index None): Paddle accumulated it
                yield name, param, parts[0][0], parts[0][1]
                continue
            index = paddle.concat([p[0] for p in parts])
            grads = paddle.concat([to_float32(p[1]) for p in parts])
            yield (name, param) + (merge_unique(index, grads) if cpu_set(index, grads)
                                   else merge_sorted(index, grads))

    def all_gradients_finite(self, head):
        """A 0-d bool tensor: every gradient the next `step` would apply is finite (this
        rank); the stashed parts are checked as they are, without merging them. Nothing is
        read back to the host."""
        return finite_flag([g for _, _, parts in self._pending(head) for _, g in parts])

    def init_state(self, head):
        """Create the state of the head's arrays (zeros, in their storage dtype) where missing,
        and return `state_dict()`: a resume fills these tensors in place."""
        for name, param in head_params(head):
            self._state_for(name, param)
        return self.state_dict()

    def _state_for(self, name, param):
        if name not in self._state:
            dtype = self.state_dtype or storage.name(param)
            self._state[name] = {key: self._zeros(key, param.shape, dtype)
                                 for key in self.state_names}
            self._init_extra_state(self._state[name], param)
        return self._state[name]

    def _zeros(self, key, shape, dtype):
        """A zero state array `key` of `shape` stored as `dtype` (8 and 4 bits: rows of two or
        more axes only, with the map `int8_maps` or `int4_maps` names; one value per row stays
        float32)."""
        if dtype.startswith(("int4", "uint4")):
            return storage.zeros(shape, "int4", self.int4_maps.get(key))
        return storage.zeros(shape, "int8" if dtype.startswith(("int8", "uint8")) else dtype,
                             self.int8_maps.get(key, "int8"))

    def _init_extra_state(self, state, param):
        pass

    def _update(self, param, state, rows, grad, lr):
        """Update the chunk `rows` of `param` and `state` (read and write through `rows`)."""
        raise NotImplementedError

    def state_dict(self):
        """Row arrays `"<param>.<state>"` (`[num_local, ...]`, in their storage: tensors or
        `Int8Rows`), and `"step_count"` (0-d int64) once a write was rounded."""
        out = {f"{name}.{key}": value for name, state in self._state.items()
               for key, value in state.items()}
        if self._rounded:
            out["step_count"] = paddle.to_tensor(self.step_count, dtype="int64")
        return out

    def set_state_dict(self, state_dict):
        """Load what `state_dict` returned: each `"<param>.<state>"` row array and
        `"step_count"`."""
        for full, value in state_dict.items():
            if full == "step_count":
                self.step_count = int(value.item() if hasattr(value, "item") else value)
                self._rounded = True
                continue
            name, key = full.rsplit(".", 1)
            self._state.setdefault(name, {})[key] = storage.as_array(value)


class SparseMomentum(SparseRowOptimizer):
    """SGD with momentum on the used rows: `g += wd·w; v = μ·v + g; w −= lr·v`
    (Nesterov: `w −= lr·(g + μ·v)`)."""

    state_names = ("velocity",)
    int8_maps = {"velocity": "int8"}
    int4_maps = {"velocity": "int4"}

    def __init__(self, learning_rate, momentum=0.9, weight_decay=0.0, use_nesterov=False,
                 state_dtype=None, rounding="stochastic", seed=0):
        super().__init__(learning_rate, state_dtype, rounding, seed)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.use_nesterov = bool(use_nesterov)

    def _update(self, param, state, rows, grad, lr):
        w = rows.read(param)
        v = rows.read(state["velocity"])
        if self.weight_decay:
            grad = grad + self.weight_decay * w
        v = self.momentum * v + grad
        step = grad + self.momentum * v if self.use_nesterov else v
        rows.write(state["velocity"], v, "velocity")
        rows.write(param, w - lr * step)


class SparseAdamW(SparseRowOptimizer):
    """AdamW on the used rows, with a per-row step count for the bias correction,
    so that a row's state advances only when the row is used."""

    state_names = ("moment1", "moment2")
    int8_maps = {"moment1": "int8_log", "moment2": "uint8_log"}
    int4_maps = {"moment1": "int4_log", "moment2": "uint4_log"}

    def __init__(self, learning_rate, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.01,
                 state_dtype=None, rounding="stochastic", seed=0):
        super().__init__(learning_rate, state_dtype, rounding, seed)
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.epsilon = float(epsilon)
        self.weight_decay = float(weight_decay)

    def _init_extra_state(self, state, param):
        state["steps"] = paddle.zeros([param.shape[0]], dtype="float32")

    def _update(self, param, state, rows, grad, lr):
        w = rows.read(param)
        m = self.beta1 * rows.read(state["moment1"]) + (1 - self.beta1) * grad
        v = self.beta2 * rows.read(state["moment2"]) + (1 - self.beta2) * grad * grad
        t = rows.read(state["steps"]) + 1.0
        rows.write(state["moment1"], m, "moment1")
        rows.write(state["moment2"], v, "moment2")
        rows.write(state["steps"], t, "steps")
        c1, c2 = _bias_corrections(self.beta1, self.beta2, t, w.place)  # [r, 1] each
        if len(w.shape) != 2:
            shape = [-1] + [1] * (len(w.shape) - 1)
            c1, c2 = c1.reshape(shape), c2.reshape(shape)
        w = w * (1.0 - lr * self.weight_decay)
        w = w - lr * (m / c1) / (sqrt_exact(v / c2) + self.epsilon)
        rows.write(param, w)


_CORRECTIONS = {}


def _bias_corrections(beta1, beta2, steps, place):
    """float32 `1 - beta1**t` and `1 - beta2**t` (`[r, 1]` each) for each row's step count t,
    looked up in tables computed in float64 on the host (1 - 0.999**t loses 4 digits in
    float32; and a vectorised pow need not round alike for every chunk length, which the fused
    update's bit-for-bit contract needs). From the t where beta**t < 2^-25 on the value is 1.0
    in float32: each table holds its value there from then on, and both stop at the later of
    the two."""
    key = (beta1, beta2, str(place))
    if key not in _CORRECTIONS:
        caps = [1 if b <= 0.0 else int(math.ceil(-25 * math.log(2) / math.log(b))) + 1
                for b in (beta1, beta2)]
        table = [[1.0 - b ** min(t, cap) for b, cap in zip((beta1, beta2), caps)]
                 for t in range(max(caps) + 1)]
        table = paddle.to_tensor(table, dtype="float64", place=place).astype("float32")
        _CORRECTIONS[key] = (table[:, 0:1].contiguous(), table[:, 1:2].contiguous())
    first, second = _CORRECTIONS[key]
    index = paddle.clip(steps, max=first.shape[0] - 1).astype("int64")
    return paddle.gather(first, index), paddle.gather(second, index)
