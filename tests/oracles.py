"""Independent references for the head: dense single-process softmax with autograd.

Nothing here calls plsc's head or margin code: the margin formula is written
again from the margin's parameters, and the loss is
`paddle.nn.functional.cross_entropy` on the full `[N, C]` logits (AdaFace and
sub-centres, `oracle_reference`: an explicit float64 log-softmax).
"""
import math

import numpy as np
import paddle
import paddle.nn.functional as F

# Paddle's cross_entropy clamps log p at -64 (CPU, fp32 and fp64); the oracle
# is only valid below that, so test data keep every sample's loss under this.
PADDLE_CE_CLAMP = 64.0


# ---- The margins' parameters, as the oracle takes them
#
# The published parameters of the named margins at their defaults, written here (not read from
# plsc): arcface_torch's CombinedMarginLoss is (s, m1, m2, m3) = (64, 1.0, 0.5, 0.0) for ArcFace
# and (64, 1.0, 0.0, 0.4) for CosFace; SphereFace is insightface's combined-margin form with
# m1 = 1.35 (the value plsc's docstring cites); AdaFace is Kim et al.'s s = 64, m = 0.4,
# h = 0.333, t_alpha = 0.01.
PUBLISHED = {
    "ArcFace": {"s": 64.0, "m1": 1.0, "m2": 0.5, "m3": 0.0},
    "CosFace": {"s": 64.0, "m1": 1.0, "m2": 0.0, "m3": 0.4},
    "SphereFace": {"s": 64.0, "m1": 1.35, "m2": 0.0, "m3": 0.0},
}
ADAFACE_PUBLISHED = {"s": 64.0, "m": 0.4, "h": 0.333, "t_alpha": 0.01}
# How each named margin's own argument `m` maps to (m1, m2, m3).
_M_IS = {"ArcFace": "m2", "CosFace": "m3", "SphereFace": "m1"}


def published_margin(name, **given):
    """plsc's margin `name` built with only the arguments `given` (the rest its defaults),
    carrying `oracle_params`: the published defaults updated by `given`, which is what the
    oracles below compute with. A wrong default in plsc then disagrees with the oracle."""
    import plsc.loss as loss
    margin = getattr(loss, name)(**given)
    params = dict(PUBLISHED[name], straight_through=bool(given.get("straight_through", False)))
    if "s" in given:
        params["s"] = float(given["s"])
    if "m" in given:
        params[_M_IS[name]] = float(given["m"])
    margin.oracle_params = params
    return margin


def margin_params(margin):
    """(s, m1, m2, m3, straight_through) the oracle uses for `margin`: the `oracle_params` a
    test attached (`published_margin`), else the parameters the test passed explicitly when it
    built the margin (read back from it; never rely on this for defaults)."""
    p = getattr(margin, "oracle_params", None)
    if p is not None:
        return p["s"], p["m1"], p["m2"], p["m3"], p["straight_through"]
    return margin.scale, margin.m1, margin.m2, margin.m3, margin.straight_through


def _numpy_sample_loss(x, w, y, margin, b):
    """Per-sample loss in float64 numpy (used only to pick well-conditioned data)."""
    x, w = x.astype("float64"), w.astype("float64")
    rows = np.arange(len(y))
    if margin.normalized:
        cos = np.clip((x / np.linalg.norm(x, axis=1, keepdims=True))
                      @ (w / np.linalg.norm(w, axis=1, keepdims=True)).T, -1.0, 1.0)
        sc, m1, m2, m3, _ = margin_params(margin)
        logits = sc * cos
        theta = np.arccos(cos[rows, y])
        logits[rows, y] = sc * (np.cos(m1 * theta + m2) - m3)
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
    s, m1, m2, m3, straight_through = margin_params(margin)
    cos = paddle.matmul(F.normalize(x, axis=1), F.normalize(w, axis=1), transpose_y=True)
    cos = paddle.clip(cos, -1.0, 1.0)
    target = s * (paddle.cos(m1 * paddle.acos(cos) + m2) - m3)
    if straight_through:
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


# ---- AdaFace and sub-centres (issue 13)
#
# Written from the formulas (the AdaFace paper's reference code; sub-centre ArcFace), not from
# plsc's margin code: every step is a float64 Paddle op and autograd gives the gradients. The
# loss is an explicit log-softmax (no clamp at -64).

ADA_EPS = 1e-3  # AdaFace's clamp margin for cosines and angles, and the std's guard
ADA_NORM_RANGE = (0.001, 100.0)


class AdaFaceOracle:
    """AdaFace's parameters and its running statistics, kept in float64.

    `update(x)` is a training step's statistics update from the global batch `x`;
    `q(x)` the per-sample margin scaler with the current statistics."""

    def __init__(self, s=64.0, m=0.4, h=0.333, t_alpha=0.01, batch_mean=20.0, batch_std=100.0):
        self.s, self.m, self.h, self.t_alpha = float(s), float(m), float(h), float(t_alpha)
        self.batch_mean, self.batch_std = float(batch_mean), float(batch_std)

    @staticmethod
    def norms(x):
        x = np.asarray(x, dtype="float64")
        return np.clip(np.sqrt((x * x).sum(axis=1)), *ADA_NORM_RANGE)

    def update(self, x):
        n = self.norms(x)
        a = self.t_alpha
        self.batch_mean = a * float(n.mean()) + (1.0 - a) * self.batch_mean
        self.batch_std = a * float(n.std(ddof=1)) + (1.0 - a) * self.batch_std
        return self

    def raw_q(self, x):
        return self.h * (self.norms(x) - self.batch_mean) / (self.batch_std + ADA_EPS)

    def q(self, x):
        return np.clip(self.raw_q(x), -1.0, 1.0)


def subcenter_cos(xt, wt, sub_centers=1):
    """`[N, C]` cosines of autograd tensors `xt: [N, d]`, `wt: [C·K, d]` (class-major: class
    j's centres are rows j·K … j·K+K−1): per class the maximum over its K centres, taken as
    argmax + gather, so the gradient goes to the first maximal centre only.

    Each cosine is an elementwise product summed over d, the same reduction for every
    (sample, centre) pair, so identical centres have bit-identical cosines (a GEMM does not
    promise that across columns)."""
    xh = F.normalize(xt, axis=1)
    wh = F.normalize(wt, axis=1)
    cos = (xh.unsqueeze(1) * wh.unsqueeze(0)).sum(axis=2)  # [N, C·K]
    if sub_centers == 1:
        return cos
    n, k = cos.shape[0], int(sub_centers)
    cos = cos.reshape([n, -1, k])
    first = paddle.argmax(cos, axis=2, keepdim=True)  # the first maximum on ties
    return paddle.take_along_axis(cos, first, axis=2).squeeze(2)


def oracle_logits(xt, wt, y, margin, sub_centers=1, q=None, filter_threshold=0.0,
                  filter_leaks=False):
    """Dense `[N, C]` logits (autograd tensors). `margin`: an `AdaFaceOracle` (with `q`, the
    per-sample scaler, `[N]` numpy) or a plsc CombinedMargin-family margin, whose formula
    `s·(cos(m1·θ + m2) − m3)` is rewritten here from its parameters.

    `filter_threshold` > 0: arcface_torch's inter-class filtering (CombinedMarginLoss's
    `interclass_filtering_threshold`), written from its definition: before the margin and the
    scale, every non-target (class) cosine above the threshold is multiplied by a constant 0
    (so its logit is 0 and it passes no gradient); the target's never. `filter_leaks`: a
    wrong rule for the tests' coverage checks: the filtered cosines are 0 in value but pass
    their gradient as if unfiltered."""
    cos = subcenter_cos(xt, wt, sub_centers)
    col = paddle.to_tensor(np.asarray(y, dtype="int64")).unsqueeze(1)
    onehot = F.one_hot(col.squeeze(1), cos.shape[1]).astype(cos.dtype)
    if filter_threshold > 0:
        keep = 1.0 - np.logical_and(cos.numpy() > filter_threshold, onehot.numpy() == 0)
        keep = paddle.to_tensor(keep.astype(cos.numpy().dtype))
        if filter_leaks:
            cos = cos - (cos * (1.0 - keep)).detach()
        else:
            cos = cos * keep  # a constant: no gradient
    if isinstance(margin, AdaFaceOracle):
        s, m = margin.s, margin.m
        c = paddle.clip(cos, -1.0 + ADA_EPS, 1.0 - ADA_EPS)  # every class
        mq = paddle.to_tensor(m * np.asarray(q, dtype="float64"), dtype=cos.dtype)
        theta = paddle.acos(paddle.take_along_axis(c, col, 1).squeeze(1))
        theta = paddle.clip(theta - mq, ADA_EPS, math.pi - ADA_EPS)
        target = s * (paddle.cos(theta) - (m + mq))
        return onehot * target.unsqueeze(1) + (1.0 - onehot) * s * c
    s, m1, m2, m3, straight_through = margin_params(margin)
    c = paddle.clip(cos, -1.0, 1.0)
    ct = paddle.take_along_axis(c, col, 1).squeeze(1)  # margins on the targets only
    target = s * (paddle.cos(m1 * paddle.acos(ct) + m2) - m3)
    if straight_through:
        target = s * ct + (target - s * ct).detach()
    return onehot * target.unsqueeze(1) + (1.0 - onehot) * s * c


def oracle_reference(x, y, w, margin, sub_centers=1, q=None, dtype="float64",
                     filter_threshold=0.0, filter_leaks=False):
    """Mean loss over the batch and its gradients w.r.t. x and w (`[C·K, d]`), as numpy; the
    per-sample losses as "per_sample". Explicit log-softmax: no clamp at -64.
    `filter_threshold`, `filter_leaks`: inter-class filtering (`oracle_logits`)."""
    def leaf(a):
        t = paddle.to_tensor(np.asarray(a), dtype=dtype)
        t.stop_gradient = False
        return t

    xt, wt = leaf(x), leaf(w)
    logits = oracle_logits(xt, wt, y, margin, sub_centers, q, filter_threshold, filter_leaks)
    col = paddle.to_tensor(np.asarray(y, dtype="int64")).unsqueeze(1)
    target = paddle.take_along_axis(logits, col, 1).squeeze(1)
    per_sample = paddle.logsumexp(logits, axis=1) - target
    loss = per_sample.mean()
    loss.backward()
    return {"loss": float(loss), "dx": xt.grad.numpy(), "dw": wt.grad.numpy(),
            "per_sample": per_sample.numpy()}


def compare_oracle(got, x, y, w, margin, sub_centers=1, q=None, tol=1e-5, filter_threshold=0.0):
    """As `compare`, against `oracle_reference`: {key: (error, allowed)} for loss, dx, dw."""
    ref = oracle_reference(x, y, w, margin, sub_centers, q, filter_threshold=filter_threshold)
    ref32 = oracle_reference(x, y, w, margin, sub_centers, q, dtype="float32",
                             filter_threshold=filter_threshold)
    return {key: (rel_err(got[key], ref[key]), max(tol, 2.0 * rel_err(ref32[key], ref[key])))
            for key in ("loss", "dx", "dw")}


def row_rel_err(actual, expected):
    """The largest per-row `rel_err` (rows whose reference is all zero: absolute error)."""
    actual = np.asarray(actual, dtype="float64")
    expected = np.asarray(expected, dtype="float64")
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = np.maximum(np.abs(expected).max(axis=1), 1e-30)
    return float((np.abs(actual - expected).max(axis=1) / scale).max())


def class_rows(index, sub_centers):
    """Weight rows (class-major, K per class) of the classes `index`."""
    index = np.asarray(index, dtype="int64")
    k = int(sub_centers)
    return (index[:, None] * k + np.arange(k)[None, :]).reshape(-1)


def make_subcenter_case(seed, n, d, num_classes, sub_centers, margin, ties=(), low=2.0,
                        high=40.0):
    """Like `make_case` for K centres per class (`w: [C·K, d]`, class-major). Each embedding
    is `a·w[centre] + noise` for a random centre of its class.

    `ties`: classes whose K centres are one row repeated, a row with two nonzero entries ±2^e:
    every product in `x·w_row` is exact and the two nonzero ones are added with one rounding
    whatever the order, so every GEMM gives such centres bit-equal cosines. (Identical dense
    rows do not: Paddle's CPU float32 GEMM computes some columns at the edge of the output,
    e.g. the last of 69, with another summation order, 1 ulp apart.) Each tied class is the
    target of a sample (among the first n/2)."""
    rng = np.random.RandomState(seed)
    k = int(sub_centers)
    w = rng.normal(0.0, 1.0, (num_classes * k, d)).astype("float32")
    for c in ties:
        row = np.zeros(d, dtype="float32")
        signs, powers = rng.choice([-1.0, 1.0], 2), 2.0 ** rng.randint(-1, 2, 2)
        row[rng.choice(d, 2, replace=False)] = signs * powers
        w[c * k:(c + 1) * k] = row
    y = rng.randint(0, num_classes, n).astype("int64")
    y[0], y[-1] = 0, num_classes - 1
    for i, c in enumerate(ties[: n // 2]):  # every tied class is some sample's target
        y[1 + i] = c
    noise = rng.normal(0.0, 1.0, (n, d))
    goal = rng.uniform(low, high, n)
    x = np.empty((n, d), dtype="float32")
    for i in range(n):
        centre = w[y[i] * k + rng.randint(k)]
        cands = np.stack([a * centre + noise[i] for a in np.linspace(-3.0, 6.0, 181)])
        cands = cands.astype("float32")
        losses = _numpy_subcenter_loss(cands, w, np.full(len(cands), y[i]), margin, k)
        x[i] = cands[np.argmin(np.abs(losses - goal[i]))]
    losses = _numpy_subcenter_loss(x, w, y, margin, k)
    assert losses.min() > 0.25 * low and losses.max() < PADDLE_CE_CLAMP - 4, losses
    return x, y, w


def _numpy_subcenter_loss(x, w, y, margin, k):
    x, w = x.astype("float64"), w.astype("float64")
    rows = np.arange(len(y))
    cos = (x / np.linalg.norm(x, axis=1, keepdims=True)) @ (w / np.linalg.norm(w, axis=1,
                                                                                keepdims=True)).T
    cos = np.clip(cos.reshape(len(y), -1, k).max(axis=2), -1.0, 1.0)
    sc, m1, m2, m3, _ = margin_params(margin)
    logits = sc * cos
    theta = np.arccos(cos[rows, y])
    logits[rows, y] = sc * (np.cos(m1 * theta + m2) - m3)
    top = logits.max(axis=1)
    return top + np.log(np.exp(logits - top[:, None]).sum(axis=1)) - logits[rows, y]


def _unit(v):
    return v / np.linalg.norm(v)


def _at_cosine(rng, direction, c):
    """A unit vector whose cosine with `direction` is `c` (the rest a random orthogonal part)."""
    u = _unit(direction.astype("float64"))
    r = rng.normal(size=u.shape)
    r = _unit(r - (r @ u) * u)
    return c * u + math.sqrt(max(0.0, 1.0 - c * c)) * r


# Statistics the AdaFace clamp cases start from (set into the margin's buffers), and h = 1:
# q = (norm − mean) / (std + 1e-3) saturates at norms below ~5 and above ~15.
ADA_CLAMP_STATS = dict(h=1.0, t_alpha=0.01, batch_mean=10.0, batch_std=5.0)

# The samples that hit AdaFace's clamps: (role, cosine with the target's centre, norm), with
# the margin m = 0.4 and the statistics above (after one update, q ≈ (norm − 10.1) / 5.2).
ADA_CLAMP_ROLES = (
    ("target_cos_above", 0.99995, 8.0),      # cos clamp at 1−1e-3 only (q ≈ −0.4)
    ("target_cos_and_angle_low", 0.99995, 30.0),  # cos clamp, then θ − m·q < 1e-3 (q = 1)
    ("angle_low", math.cos(0.2), 30.0),     # cos in range, θ − m·q = 0.2 − 0.4 < 1e-3
    ("angle_high", -0.95, 0.5),             # θ − m·q = 2.82 + 0.4 > π − 1e-3 (q = −1)
    ("other_cos_both", None, 12.0),         # ≈ centre a: cos(a) > 1−1e-3, cos(b) < −1+1e-3
    ("norm_above", 0.3, 300.0),             # norm clamped to 100 (q = 1)
    ("target_cos_below", None, 12.0),       # target b while ≈ centre a: cos(b) < −1+1e-3
    ("q_low", 0.4, 2.0),                    # q clipped at −1, nothing else
    ("plain_pos", 0.5, 11.0),               # q ≈ 0.17; target a (a, b always positives)
    ("plain_neg", 0.45, 9.0),               # q ≈ −0.2
)


def make_adaface_case(seed, n, d, num_classes, tiny=False):
    """AdaFace data hitting every clamp (see ADA_CLAMP_ROLES: the first n samples take those
    roles in order, the rest are plain): returns x, y, w and the roles list. Classes a, b
    (a ≠ b, random) have antiparallel centres (w_b = −0.7·w_a); both are targets of some
    sample when n ≥ 9, so Partial FC always samples them.

    `tiny`: instead, norms for the statistics mean 0.0015, std 0.002 (eval mode): sample 0
    has norm 1e-5 (clamped to 0.001: q changes from −0.165 to −0.055), sample 1 norm 0.0012,
    the rest norms in [0.0008, 0.004] (q unsaturated or saturated at +1)."""
    rng = np.random.RandomState(seed)
    w = rng.normal(0.0, 1.0, (num_classes, d))
    a, b = rng.choice(num_classes, 2, replace=False)
    w[b] = -0.7 * w[a]
    w = w.astype("float32")
    y = rng.randint(0, num_classes, n).astype("int64")
    y[0], y[-1] = 0, num_classes - 1
    x = np.empty((n, d))
    roles = []
    for i in range(n):
        if tiny:
            c = rng.uniform(0.2, 0.8)
            norm = 1e-5 if i == 0 else 0.0012 if i == 1 else rng.uniform(0.0008, 0.004)
            x[i] = norm * _at_cosine(rng, w[y[i]], c)
            roles.append("tiny_norm" if i == 0 else "plain")
            continue
        role, c, norm = ADA_CLAMP_ROLES[i] if i < len(ADA_CLAMP_ROLES) else \
            ("plain", rng.uniform(0.1, 0.8), rng.uniform(7.0, 13.0))
        roles.append(role)
        if role == "plain_pos":
            y[i] = a
        if role in ("other_cos_both", "target_cos_below"):
            if role == "target_cos_below":
                y[i] = b
            else:
                while y[i] in (a, b):
                    y[i] = rng.randint(num_classes)
            x[i] = norm * _at_cosine(rng, w[a], 0.99995)
        else:
            x[i] = norm * _at_cosine(rng, w[y[i]], c)
    return x.astype("float32"), y, w, roles


def adaface_clamp_hits(x, y, w, oracle):
    """Which clamps the float64 data hit (with `oracle`'s current statistics): a dict of
    counts, for the tests to assert the coverage they claim."""
    x64, w64 = np.asarray(x, "float64"), np.asarray(w, "float64")
    raw = np.sqrt((x64 * x64).sum(axis=1))
    cos = (x64 / raw[:, None]) @ (w64 / np.linalg.norm(w64, axis=1, keepdims=True)).T
    rows = np.arange(len(y))
    onehot = np.zeros_like(cos, dtype=bool)
    onehot[rows, y] = True
    hi, lo = 1.0 - ADA_EPS, -1.0 + ADA_EPS
    theta = np.arccos(np.clip(cos[rows, y], lo, hi)) - oracle.m * oracle.q(x)
    raw_q = oracle.raw_q(x)
    return {
        "norm_below": int((raw < ADA_NORM_RANGE[0]).sum()),
        "norm_above": int((raw > ADA_NORM_RANGE[1]).sum()),
        "q_above": int((raw_q > 1.0).sum()), "q_below": int((raw_q < -1.0).sum()),
        "target_cos_above": int((cos[onehot] > hi).sum()),
        "target_cos_below": int((cos[onehot] < lo).sum()),
        "other_cos_above": int((cos[~onehot] > hi).sum()),
        "other_cos_below": int((cos[~onehot] < lo).sum()),
        "angle_below": int((theta < ADA_EPS).sum()),
        "angle_above": int((theta > math.pi - ADA_EPS).sum()),
    }


def finite_difference_grads(loss, x, w, eps=1e-6):
    """{"dx", "dw"}: central differences of `loss(x, w)` (float64 arrays) in every entry."""
    x64, w64 = np.array(x, dtype="float64"), np.array(w, dtype="float64")
    out = {}
    for arr, key in ((x64, "dx"), (w64, "dw")):
        num = np.zeros_like(arr)
        for idx in np.ndindex(*arr.shape):
            old = arr[idx]
            arr[idx] = old + eps
            up = loss(x64, w64)
            arr[idx] = old - eps
            down = loss(x64, w64)
            arr[idx] = old
            num[idx] = (up - down) / (2 * eps)
        out[key] = num
    return out


# ---- Inter-class filtering (issue 23)
#
# arcface_torch's `interclass_filtering_threshold` (CombinedMarginLoss): non-target cosines
# above the threshold become 0 before the margin and the scale, without gradient. The oracle
# is `oracle_logits(..., filter_threshold=t)`; below, data that exercise it.

FILTER_GAP = 1e-3  # no class cosine this close to the threshold: float32 and float64 agree


def class_cosines(x, w, sub_centers=1):
    """`[N, C]` float64 cosines of the embeddings `x` with the classes of `w` (`[C·K, d]`,
    class-major): per class the largest of its K centres'."""
    x64, w64 = np.asarray(x, "float64"), np.asarray(w, "float64")
    cos = (x64 / np.linalg.norm(x64, axis=1, keepdims=True)) @ \
        (w64 / np.linalg.norm(w64, axis=1, keepdims=True)).T
    k = int(sub_centers)
    return cos if k == 1 else cos.reshape(len(x64), -1, k).max(axis=2)


def filtered_mask(x, y, w, threshold, sub_centers=1):
    """`[N, C]` bool: the entries inter-class filtering removes (non-target, cosine > t)."""
    cos = class_cosines(x, w, sub_centers)
    onehot = np.zeros(cos.shape, dtype=bool)
    onehot[np.arange(len(y)), np.asarray(y)] = True
    return np.logical_and(cos > threshold, ~onehot)


def make_conflict_case(seed, n, d, num_classes, threshold, sub_centers=1, antiparallel=False):
    """x, y, w (`[C·K, d]`) for inter-class filtering at `threshold`. Every sample has a
    "conflicting" identity: a second class (not its own) whose centre has cosine in
    [t + 0.05, 0.9] with it, so it is filtered; its own class's cosine is above t for the even
    samples (uniform in [t + 0.05, 0.7]: such targets must not be filtered) and below it for
    the odd ones (uniform in [−0.3, t − 0.05]). Norms are uniform in [1, 10]. No class cosine
    lies within FILTER_GAP of t. `antiparallel`: sample 1 points away from a centre of
    a class not its own (cosine < −0.9999: AdaFace clamps it as well)."""
    rng = np.random.RandomState(seed)
    k = int(sub_centers)
    w = rng.normal(0.0, 1.0, (num_classes * k, d)).astype("float32")
    y = rng.randint(0, num_classes, n).astype("int64")
    y[0], y[-1] = 0, num_classes - 1
    x = np.empty((n, d), dtype="float32")
    t = float(threshold)
    for i in range(n):
        while True:
            u = _unit(w[y[i] * k + rng.randint(k)].astype("float64"))
            other = rng.randint(num_classes - 1)
            other += other >= y[i]
            if antiparallel and i == 1:
                v = _unit(w[other * k + rng.randint(k)].astype("float64"))
                cand = -v + 0.005 * _unit(rng.normal(size=d))
            else:
                a = rng.uniform(t + 0.05, 0.7) if i % 2 == 0 else rng.uniform(-0.3, t - 0.05)
                b = rng.uniform(t + 0.05, 0.9)
                v = _unit(w[other * k + rng.randint(k)].astype("float64"))
                uv = float(u @ v)
                v_perp = v - uv * u
                if np.linalg.norm(v_perp) < 0.1:
                    continue
                alpha, beta = a, (b - a * uv) / np.linalg.norm(v_perp)
                if alpha * alpha + beta * beta >= 0.98:
                    continue
                r = rng.normal(size=d)
                r -= (r @ u) * u
                vp = _unit(v_perp)
                r = _unit(r - (r @ vp) * vp)
                cand = alpha * u + beta * vp + math.sqrt(1 - alpha * alpha - beta * beta) * r
            cand = (rng.uniform(1.0, 10.0) * _unit(cand)).astype("float32")
            cos = class_cosines(cand[None], w, k)[0]
            if np.abs(cos - t).min() > FILTER_GAP:
                x[i] = cand
                break
    return x, y, w
