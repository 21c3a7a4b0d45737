"""Independent references for the head: dense single-process softmax with autograd.

Nothing here calls plsc's head or margin code: the margin formula is written
again from the margin's parameters, and the loss is
`paddle.nn.functional.cross_entropy` on the full `[N, C]` logits.
"""
import numpy as np
import paddle
import paddle.nn.functional as F

# Paddle's cross_entropy clamps log p at -64 (CPU, fp32 and fp64); the oracle
# is only valid below that, so test data keep every sample's loss under this.
PADDLE_CE_CLAMP = 64.0


def _numpy_sample_loss(x, w, y, margin, b):
    """Per-sample loss in float64 numpy (used only to pick well-conditioned data)."""
    x, w = x.astype("float64"), w.astype("float64")
    rows = np.arange(len(y))
    if margin.normalized:
        cos = np.clip((x / np.linalg.norm(x, axis=1, keepdims=True))
                      @ (w / np.linalg.norm(w, axis=1, keepdims=True)).T, -1.0, 1.0)
        logits = margin.scale * cos
        theta = np.arccos(cos[rows, y])
        logits[rows, y] = margin.scale * (np.cos(margin.m1 * theta + margin.m2) - margin.m3)
    else:
        logits = x @ w.T + (0.0 if b is None else b)
    top = logits.max(axis=1)
    return top + np.log(np.exp(logits - top[:, None]).sum(axis=1)) - logits[rows, y]


def make_case(seed, n, d, num_classes, margin, low=2.0, high=40.0):
    """Global batch, labels, full class centres (and bias for plain softmax).

    Each embedding is `a·w[label] + noise` with `a` chosen so that its loss lies
    in [low, high]: away from 0, where fp32 cannot resolve `1 - p`, and from
    Paddle's clamp at 64.
    """
    rng = np.random.RandomState(seed)
    w = rng.normal(0.0, 1.0, (num_classes, d)).astype("float32")
    b = None if margin.normalized else rng.normal(0.0, 1.0, num_classes).astype("float32")
    y = rng.randint(0, num_classes, n).astype("int64")
    y[0], y[-1] = 0, num_classes - 1  # both ends of the class range
    noise = rng.normal(0.0, 1.0, (n, d))
    goal = rng.uniform(low, high, n)
    x = np.empty((n, d), dtype="float32")
    for i in range(n):
        cands = np.stack([a * w[y[i]] + noise[i] for a in np.linspace(-3.0, 6.0, 181)])
        cands = cands.astype("float32")
        losses = _numpy_sample_loss(cands, w, np.full(len(cands), y[i]), margin, b)
        x[i] = cands[np.argmin(np.abs(losses - goal[i]))]
    losses = _numpy_sample_loss(x, w, y, margin, b)
    assert losses.min() > 0.25 * low and losses.max() < PADDLE_CE_CLAMP - 4, losses
    return x, y, w, b


def margin_logits(x, w, y, margin, b=None):
    """Dense logits `[N, C]` with the margin on the target entries (autograd-friendly)."""
    if not margin.normalized:
        out = paddle.matmul(x, w, transpose_y=True)
        return out + b if b is not None else out
    s, m1, m2, m3 = margin.scale, margin.m1, margin.m2, margin.m3
    cos = paddle.matmul(F.normalize(x, axis=1), F.normalize(w, axis=1), transpose_y=True)
    cos = paddle.clip(cos, -1.0, 1.0)
    target = s * (paddle.cos(m1 * paddle.acos(cos) + m2) - m3)
    if margin.straight_through:
        # insightface: the margin is applied without gradient.
        target = s * cos + (target - s * cos).detach()
    onehot = F.one_hot(paddle.to_tensor(y), w.shape[0]).astype(cos.dtype)
    return onehot * target + (1.0 - onehot) * s * cos


def dense_reference(x, y, w, margin, b=None, dtype="float64"):
    """Mean loss over the batch and its gradients w.r.t. x, w (and b), as numpy."""
    def leaf(a):
        t = paddle.to_tensor(np.asarray(a), dtype=dtype)
        t.stop_gradient = False
        return t

    xt, wt = leaf(x), leaf(w)
    bt = leaf(b) if b is not None else None
    logits = margin_logits(xt, wt, y, margin, bt)
    per_sample = F.cross_entropy(logits, paddle.to_tensor(y).unsqueeze(1), reduction="none")
    worst = float(per_sample.max())
    if worst >= PADDLE_CE_CLAMP:
        raise AssertionError(f"oracle invalid: a sample's loss {worst} reaches Paddle's clamp at 64")
    loss = per_sample.mean()
    loss.backward()
    out = {"loss": float(loss), "dx": xt.grad.numpy(), "dw": wt.grad.numpy()}
    if bt is not None:
        out["db"] = bt.grad.numpy()
    return out


def compare(got, x, y, w, margin, b=None, tol=1e-5):
    """Relative error of each of `got`'s entries against the float64 dense oracle.

    Returns {key: (error, allowed)}. The allowance is `tol`, or twice the error of
    the same dense computation done in float32 where that is larger: a result that
    cancels (e.g. the bias gradient of a 2-class softmax) cannot be resolved in
    fp32 better than the dense fp32 computation resolves it.
    """
    ref = dense_reference(x, y, w, margin, b)
    ref32 = dense_reference(x, y, w, margin, b, dtype="float32")
    return {key: (rel_err(got[key], ref[key]), max(tol, 2.0 * rel_err(ref32[key], ref[key])))
            for key in ref}


def rel_err(actual, expected):
    """max |a - e| / max |e|: the error relative to the reference's scale."""
    actual = np.asarray(actual, dtype="float64")
    expected = np.asarray(expected, dtype="float64")
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.abs(expected).max()), 1e-30)
    return float(np.abs(actual - expected).max()) / scale
