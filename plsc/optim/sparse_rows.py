"""Optimizers for the head that touch only the rows a step used.

With Partial FC a step has gradients for the sampled class centres only.
These optimizers update those rows of `head.weight` (and `head.bias`) and of
their optimizer state, and nothing else: rows that were not sampled keep
their values and their momentum bit for bit, and weight decay applies to the
sampled rows only. At `sample_ratio = 1` every row is "sampled" and the
update is the ordinary dense one.

The formulas are Paddle's: `Momentum` with L2 weight decay added to the
gradient, and `AdamW` with decoupled decay.
"""
import paddle

__all__ = ["SparseRowOptimizer", "SparseMomentum", "SparseAdamW"]

_CHUNK = 1024  # rows updated at a time: temporaries stay cache-sized


class SparseRowOptimizer:
    """Base: walks the head's (parameter, rows, gradient rows) and updates them in chunks."""

    state_names = ()

    def __init__(self, learning_rate):
        self.learning_rate = learning_rate
        self._state = {}
        self._stash = {}

    def get_lr(self):
        lr = self.learning_rate
        return float(lr() if callable(lr) else lr)

    def stash(self, head):
        """Keep the sampled rows' gradients of a micro-batch for the next `step`
        (gradient accumulation with Partial FC: each micro-batch samples anew)."""
        for name, _, index, rows in _head_rows(head):
            if index is not None and rows is not None and rows.grad is not None:
                self._stash.setdefault(name, []).append((index, rows.grad))
        head.release_sampled_rows(gradients_kept=True)

    def step(self, head, grad_scale=1.0):
        """Apply the gradients of the head's last backward (times `grad_scale`, e.g. the
        inverse loss scale), plus any stashed ones, then release them."""
        lr = self.get_lr()
        for name, param, index, grad in self._gradients(head):
            state = self._state_for(name, param)
            with paddle.no_grad():
                if grad_scale != 1.0:
                    grad = grad * grad_scale
                for start in range(0, grad.shape[0], _CHUNK):
                    stop = min(start + _CHUNK, grad.shape[0])
                    idx = index[start:stop] if index is not None else None
                    self._update(param, state, idx, start, stop, grad[start:stop], lr)
            if index is None:
                param.grad = None  # frees it; clear_gradient(set_to_zero=False) does not (Paddle 3.3)
        self._stash = {}
        head.release_sampled_rows()

    def discard(self, head):
        """Drop the pending gradients without applying them (a skipped step)."""
        self._stash = {}
        for _, param, index, _ in _head_rows(head):
            if index is None:
                param.grad = None
        head.release_sampled_rows()

    def _pending(self, head):
        """(name, parameter, [(row index or None, gradient rows), ...]) awaiting `step`."""
        for name, param, index, rows in _head_rows(head):
            parts = list(self._stash.get(name, ()))
            if rows is not None and rows.grad is not None:
                parts.append((index, rows.grad))
            if parts:
                yield name, param, parts

    def _gradients(self, head):
        """(name, parameter, unique sorted row index or None, gradient rows) to apply."""
        for name, param, parts in self._pending(head):
            if len(parts) == 1:  # also the dense case (index None): Paddle accumulated it
                yield name, param, parts[0][0], parts[0][1]
                continue
            index = paddle.concat([p[0] for p in parts])
            unique, inverse = paddle.unique(index, return_inverse=True)
            grads = paddle.concat([p[1] for p in parts])
            summed = paddle.zeros([unique.shape[0]] + list(grads.shape[1:]), dtype=grads.dtype)
            yield name, param, unique, summed.index_add_(inverse.reshape([-1]), 0, grads)

    def all_gradients_finite(self, head):
        """A 0-d bool tensor: every gradient the next `step` would apply is finite (this
        rank); the stashed parts are checked as they are, without merging them. Nothing is
        read back to the host."""
        flags = [paddle.isfinite(g).all() for _, _, parts in self._pending(head) for _, g in parts]
        return paddle.stack(flags).all() if flags else paddle.to_tensor(True)

    def _state_for(self, name, param):
        if name not in self._state:
            self._state[name] = {key: paddle.zeros(param.shape, dtype=param.dtype)
                                 for key in self.state_names}
            self._init_extra_state(self._state[name], param)
        return self._state[name]

    def _init_extra_state(self, state, param):
        pass

    def _update(self, param, state, idx, start, stop, grad, lr):
        raise NotImplementedError

    def state_dict(self):
        return {f"{name}.{key}": value for name, state in self._state.items()
                for key, value in state.items()}

    def set_state_dict(self, state_dict):
        for full, value in state_dict.items():
            name, key = full.rsplit(".", 1)
            self._state.setdefault(name, {})[key] = paddle.to_tensor(value)


def _head_rows(head):
    """(name, parameter, row index or None for all rows, tensor carrying the gradient)."""
    sampled = head.sampled_index is not None
    yield ("weight", head.weight, head.sampled_index if sampled else None,
           head.sampled_weight if sampled else head.weight)
    if head.bias is not None:
        yield ("bias", head.bias, head.sampled_index if sampled else None,
               head.sampled_bias if sampled else head.bias)


def _read(t, idx, start, stop):
    return paddle.gather(t, idx) if idx is not None else t[start:stop]


def _write(t, idx, start, stop, value):
    if idx is not None:
        t.scatter_(idx, value, overwrite=True)
    else:
        t[start:stop] = value


class SparseMomentum(SparseRowOptimizer):
    """SGD with momentum on the used rows: `g += wd·w; v = μ·v + g; w −= lr·v`
    (Nesterov: `w −= lr·(g + μ·v)`)."""

    state_names = ("velocity",)

    def __init__(self, learning_rate, momentum=0.9, weight_decay=0.0, use_nesterov=False):
        super().__init__(learning_rate)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.use_nesterov = bool(use_nesterov)

    def _update(self, param, state, idx, start, stop, grad, lr):
        w = _read(param, idx, start, stop)
        v = _read(state["velocity"], idx, start, stop)
        if self.weight_decay:
            grad = grad + self.weight_decay * w
        v = self.momentum * v + grad
        step = grad + self.momentum * v if self.use_nesterov else v
        _write(state["velocity"], idx, start, stop, v)
        _write(param, idx, start, stop, w - lr * step)


class SparseAdamW(SparseRowOptimizer):
    """AdamW on the used rows, with a per-row step count for the bias correction,
    so that a row's state advances only when the row is used."""

    state_names = ("moment1", "moment2")

    def __init__(self, learning_rate, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.01):
        super().__init__(learning_rate)
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.epsilon = float(epsilon)
        self.weight_decay = float(weight_decay)

    def _init_extra_state(self, state, param):
        state["steps"] = paddle.zeros([param.shape[0]], dtype="float32")

    def _update(self, param, state, idx, start, stop, grad, lr):
        w = _read(param, idx, start, stop)
        m = self.beta1 * _read(state["moment1"], idx, start, stop) + (1 - self.beta1) * grad
        v = self.beta2 * _read(state["moment2"], idx, start, stop) + (1 - self.beta2) * grad * grad
        t = _read(state["steps"], idx, start, stop) + 1.0
        _write(state["moment1"], idx, start, stop, m)
        _write(state["moment2"], idx, start, stop, v)
        _write(state["steps"], idx, start, stop, t)
        # Bias corrections in float64: 1 - 0.999**t loses 4 digits in float32.
        shape = [-1] + [1] * (len(w.shape) - 1)
        t64 = t.astype("float64")
        c1 = (1.0 - paddle.pow(paddle.full_like(t64, self.beta1), t64)).astype(w.dtype).reshape(shape)
        c2 = (1.0 - paddle.pow(paddle.full_like(t64, self.beta2), t64)).astype(w.dtype).reshape(shape)
        w = w * (1.0 - lr * self.weight_decay)
        w = w - lr * (m / c1) / (paddle.sqrt(v / c2) + self.epsilon)
        _write(param, idx, start, stop, w)
