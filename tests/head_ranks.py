"""Runs the head's multi-rank cases in one group of real gloo ranks.

    python tests/head_ranks.py --nprocs K --out results.json

Every rank builds the same global data; rank 0 writes one JSON object with,
per case, the relative errors against the oracles (or the error raised).
"""
import argparse
import json
import os
import sys
import traceback
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from oracles import margin_params, published_margin  # noqa: E402

B, D = 5, 16  # per-rank batch and embedding width
CLASS_COUNTS = (10, 23, 101)
SAMPLED = (("arcface", 101, 0.5), ("softmax", 101, 0.5), ("cosface", 23, 0.3))
CHUNKED = (("arcface", 101, 1.0, 7), ("softmax", 23, 1.0, 3), ("combined", 23, 1.0, 2),
           ("cosface", 101, 0.5, 5))  # (margin, classes, sample ratio, chunk size)


def margins():
    from plsc.loss import CombinedMargin, Softmax
    return {  # the named margins at their defaults, checked against the published parameters
        "arcface": published_margin("ArcFace"),
        "arcface_st": published_margin("ArcFace", straight_through=True),
        "cosface": published_margin("CosFace"),
        "sphereface": published_margin("SphereFace"),
        "combined": CombinedMargin(64.0, 1.2, 0.3, 0.1),
        "softmax": Softmax(),
    }


def oracle_cases():
    """(margin name, margin, num_classes, sample_ratio, chunk_size) of every oracle case."""
    ms = margins()
    cases = [(name, m, c, 1.0, 0) for c in CLASS_COUNTS for name, m in ms.items()]
    cases += [(name, ms[name], c, r, 0) for name, c, r in SAMPLED]
    return cases + [(name, ms[name], c, r, k) for name, c, r, k in CHUNKED]


def case_name(margin_name, num_classes, ratio, chunk=0):
    return (f"{margin_name}-C{num_classes}" + (f"-rho{ratio}" if ratio < 1 else "")
            + (f"-chunk{chunk}" if chunk else ""))


def gather_rows(t, pad_to=None):
    """All ranks' `t` concatenated (padding axis 0 to `pad_to` rows, then trimming)."""
    import paddle
    from plsc.distributed import gather_concat, get_world_size
    n = t.shape[0]
    if pad_to is not None and n < pad_to:
        t = paddle.concat([t, paddle.zeros([pad_to - n] + list(t.shape[1:]), t.dtype)])
    parts = gather_concat(t).numpy()
    if pad_to is None:
        return parts
    counts = gather_concat(paddle.to_tensor([n], dtype="int64")).numpy()
    k = get_world_size()
    chunks = np.split(parts, k)
    return np.concatenate([c[:m] for c, m in zip(chunks, counts)])


def plsc_literal(x, y, w, b, margin, num_classes, k):
    """PLSC's steps for k ranks, simulated in this one process (no collective: each rank's
    inputs are all here, from the shared test case), each step a float64 Paddle op with
    autograd: rank r owns classes [r·shard, min((r+1)·shard, C)) with shard = ceil(C/k)
    (paddle.shard_index's split, written here), the all-gather is a concatenation of the
    ranks' batches, shard_index, the MAX and SUM all-reduces are a max and a sum over the
    ranks' row values, the min trick on log p ⊙ onehot, and the reduce-scatter a sum over
    ranks sliced by rank. Returns the global loss and each rank's gradients:
    {"loss": float, "dx": [per rank], "dw": [...], "db": [...] or None}. Float64, so that it
    measures the head's fp32 error, not its own."""
    import paddle
    import paddle.nn.functional as F

    n = x.shape[0]
    per = n // k
    shard = -(-num_classes // k)
    bounds = [(r * shard, min((r + 1) * shard, num_classes)) for r in range(k)]
    f64 = lambda a: leaf(np.asarray(a, dtype="float64"))  # noqa: E731
    xs = [f64(x[r * per:(r + 1) * per]) for r in range(k)]
    ws = [f64(w[lo:hi]) for lo, hi in bounds]
    bs = [f64(b[lo:hi]) for lo, hi in bounds] if b is not None else None
    gx = paddle.concat(xs)  # the all-gather
    gy = paddle.to_tensor(np.asarray(y, dtype="int64")).unsqueeze(1)
    logits, onehots = [], []
    for r, (lo, hi) in enumerate(bounds):
        n_local = hi - lo
        shard_label = paddle.shard_index(gy, num_classes, k, r, ignore_value=-1)
        shard_label = paddle.where(shard_label < 0, paddle.full_like(shard_label, n_local),
                                   shard_label)
        onehot = F.one_hot(shard_label.squeeze(1), n_local + 1)[:, :n_local].astype(gx.dtype)
        if margin.normalized:
            cos = paddle.matmul(F.normalize(gx, axis=1), F.normalize(ws[r], axis=1),
                                transpose_y=True)
            cos = paddle.clip(cos, -1.0, 1.0)
            s, m1, m2, m3, straight_through = margin_params(margin)
            target = s * (paddle.cos(m1 * paddle.acos(cos) + m2) - m3)
            if straight_through:
                target = s * cos + (target - s * cos).detach()
            logit = onehot * target + (1.0 - onehot) * s * cos
        else:
            logit = paddle.matmul(gx, ws[r], transpose_y=True) + bs[r]
        logits.append(logit)
        onehots.append(onehot)
    # MAX all-reduce of the row maxima (no gradient, as in PLSC), SUM all-reduce of the sums.
    row_max = paddle.stack([lg.max(axis=1, keepdim=True) for lg in logits]).max(axis=0).detach()
    sum_exp = paddle.add_n([paddle.exp(lg - row_max).sum(axis=1, keepdim=True) for lg in logits])
    losses = []
    for r in range(k):
        log_prob = logits[r] - row_max - paddle.log(sum_exp)
        target_log_prob = (log_prob * onehots[r]).min(axis=1)  # log p[target] or 0
        losses.append(-target_log_prob)
    summed = paddle.add_n(losses)  # the reduce-scatter: a sum over ranks ...
    local = [summed[r * per:(r + 1) * per].sum() / n for r in range(k)]  # ... sliced by rank
    total = paddle.add_n(local)  # every rank's loss, each backpropagated: their sum
    total.backward()
    return {"loss": float(total), "dx": [t.grad.numpy() for t in xs],
            "dw": [t.grad.numpy() for t in ws],
            "db": [t.grad.numpy() for t in bs] if bs is not None else None}


def leaf(a):
    import paddle
    t = paddle.to_tensor(a)
    t.stop_gradient = False
    return t


def check_against_oracles(margin, num_classes, ratio=1.0, chunk=0):
    """The head on this group vs the dense oracle (restricted to the sampled classes when
    ratio < 1) on rank 0 and, at ratio 1, vs the PLSC-literal steps on every rank."""
    import paddle
    from oracles import compare, make_case, rel_err
    from plsc.distributed import get_rank, get_world_size
    from plsc.nn import PartialFC

    rank, k = get_rank(), get_world_size()
    x, y, w, b = make_case(seed=num_classes * 7 + k, n=k * B, d=D, num_classes=num_classes,
                           margin=margin)
    head = PartialFC(D, num_classes, margin, sample_ratio=ratio, seed=5, chunk_size=chunk)
    lo, hi = head.class_start, head.class_start + head.num_local
    head.weight.set_value(w[lo:hi])
    if b is not None:
        head.bias.set_value(b[lo:hi])
    x_local = leaf(x[rank * B:(rank + 1) * B])
    y_local = paddle.to_tensor(y[rank * B:(rank + 1) * B])
    loss = head(x_local, y_local)
    loss.backward()
    losses = gather_rows(paddle.to_tensor([float(loss)]))
    dx = gather_rows(x_local.grad)
    shard = head.partition.shard_size
    sampled = ratio < 1.0
    w_rows = head.sampled_weight if sampled else head.weight
    b_rows = head.sampled_bias if sampled else head.bias
    dw = gather_rows(w_rows.grad, pad_to=shard)
    db = gather_rows(b_rows.grad, pad_to=shard) if b is not None else None
    used = np.arange(num_classes)
    if sampled:
        used = gather_rows(head.sampled_index + lo, pad_to=shard)

    lit_worst = None
    if not sampled:  # Oracle 2 on every rank, compared rank by rank.
        literal = plsc_literal(x, y, w, b, margin, num_classes, k)
        lit = {
            "loss": rel_err([float(loss)], [literal["loss"]]),
            "dx": rel_err(x_local.grad.numpy(), literal["dx"][rank]),
            "dw": rel_err(head.weight.grad.numpy(), literal["dw"][rank]),
        }
        if b is not None:
            lit["db"] = rel_err(head.bias.grad.numpy(), literal["db"][rank])
        lit_worst = gather_rows(paddle.to_tensor([max(lit.values())], dtype="float64"))

    if rank != 0:
        return None
    got = {"loss": float(loss), "dx": dx, "dw": dw}
    if b is not None:
        got["db"] = db
    remapped = np.searchsorted(used, y)
    assert np.array_equal(used[remapped], y), "a positive was not sampled"
    errs = compare(got, x, remapped, w[used], margin, b[used] if b is not None else None)
    errs["loss_same_on_all_ranks"] = (float(np.ptp(losses)), 0.0)
    if lit_worst is not None:
        errs["plsc_literal"] = (float(lit_worst.max()), 1e-5)
    return errs


def expect_error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def check_bad_input():
    """Bad labels or unequal batches on one rank raise the same ValueError everywhere."""
    import paddle
    from plsc.distributed import get_rank, gather_concat
    from plsc.nn import PartialFC

    rank = get_rank()
    head = PartialFC(D, 23)
    x = paddle.randn([B, D])
    good = paddle.arange(B, dtype="int64")
    out = {}
    bad = good.clone()
    if rank == 1:
        bad[2] = 23
    out["bad_label"] = expect_error(lambda: head(x, bad))
    neg = good.clone()
    if rank == 0:
        neg[0] = -4
    out["negative_label"] = expect_error(lambda: head(x, neg))
    # check_inputs="labels": nothing read in the step; loss_value raises for the bad label.
    lazy = PartialFC(D, 23, check_inputs="labels")
    loss = lazy(x, bad)
    loss.backward()
    out["deferred_bad_label"] = expect_error(lambda: lazy.loss_value(loss))
    out["deferred_good_equals_float"] = lazy.loss_value(lazy(x, good)) == float(lazy(x, good))
    xb = x[:B - 1] if rank == 1 else x
    out["uneven_batch"] = expect_error(lambda: head(xb, good[:xb.shape[0]]))
    # The group is still healthy: a normal step agrees on every rank.
    loss = float(head(x, good))
    out["after_errors_ok"] = bool(np.ptp(gather_concat(paddle.to_tensor([loss])).numpy()) == 0)
    msgs = {key: v for key, v in out.items() if key != "after_errors_ok"}
    same = gather_concat(paddle.to_tensor([zlib.crc32(json.dumps(msgs).encode())], dtype="int64"))
    out["same_on_all_ranks"] = bool(len(set(same.numpy().tolist())) == 1)
    return out if rank == 0 else None


def check_collectives():
    """all_gather / reduce_scatter forward and backward against their definitions, with inputs
    that differ by rank and by row; every rank's verdict is collected (Paddle's own
    `all_gather_object`, not the collectives under test) and reported as `rank{r}.{check}`."""
    import paddle
    import paddle.distributed as dist
    from plsc.distributed import all_gather, get_rank, get_world_size, reduce_scatter

    rank, k = get_rank(), get_world_size()
    rows = lambda r: np.arange(6, dtype="float32").reshape(2, 3) + 10 * r  # noqa: E731
    x = leaf(rows(rank))
    g = all_gather(x)
    coef = paddle.to_tensor(np.arange(2 * k * 3, dtype="float32").reshape(2 * k, 3) * (rank + 1))
    (g * coef).sum().backward()
    full = np.concatenate([rows(r) for r in range(k)])
    expect_grad = sum(np.arange(2 * k * 3, dtype="float32").reshape(2 * k, 3) * (r + 1)
                      for r in range(k))[2 * rank:2 * rank + 2]
    # Row i, column j of rank r's input: 1000 (r + 1) + 10 i + j (exact in float32), so each
    # output row tells which rows of which ranks were summed into it.
    zin = lambda r: (1000.0 * (r + 1) + 10.0 * np.arange(2 * k)[:, None]  # noqa: E731
                     + np.arange(3)[None, :]).astype("float32")
    z = leaf(zin(rank))
    rs = reduce_scatter(z)
    out_coef = np.arange(6, dtype="float32").reshape(2, 3) + 7.0 * (rank + 1)
    (rs * paddle.to_tensor(out_coef)).sum().backward()
    expect_rs = sum(zin(q) for q in range(k))[2 * rank:2 * rank + 2]
    # d/dz_r of sum_q <rs_q, c_q>: every rank's output slice q comes from rows 2q, 2q+1 of z_r.
    expect_zgrad = np.concatenate([np.arange(6, dtype="float32").reshape(2, 3) + 7.0 * (q + 1)
                                   for q in range(k)])
    ok = {
        "all_gather_forward": bool(np.array_equal(g.numpy(), full)),
        "all_gather_backward": bool(np.allclose(x.grad.numpy(), expect_grad, rtol=0, atol=0)),
        "reduce_scatter_forward": bool(np.array_equal(rs.numpy(), expect_rs)),
        "reduce_scatter_backward": bool(np.array_equal(z.grad.numpy(), expect_zgrad)),
    }
    every = []
    dist.all_gather_object(every, ok)
    return {f"rank{r}.{key}": value for r, verdict in enumerate(every) for key, value in verdict.items()}


# ---- 16-bit storage and the fused optimizer update

DTYPES = ("bfloat16", "float16", "int8")
DTYPE_MARGINS = ("arcface", "cosface", "softmax")
DTYPE_SHAPES = ((101, 1.0, 0), (101, 1.0, 7), (101, 0.5, 0), (101, 0.5, 7))  # (C, ratio, chunk)
# Half of a 16-bit ulp relative to the value: a 16-bit gradient's rounding error (an 8-bit
# weight's gradient is float32).
HALF_ULP = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "int8": 0.0}


def dtype_cases():
    """(dtype, margin name, num_classes, sample_ratio, chunk_size) of the 16-bit head cases."""
    return [(dt, m, c, r, k) for dt in DTYPES for m in DTYPE_MARGINS for c, r, k in DTYPE_SHAPES]


def dtype_case_name(dtype, margin_name, num_classes, ratio, chunk):
    return f"{dtype}-" + case_name(margin_name, num_classes, ratio, chunk)


def rounded(a, dtype):
    """float32 numpy values of `a` rounded to `dtype` by Paddle's cast (to nearest even); int8:
    the values an 8-bit head stores for `a` (rows of two axes, quantised to nearest with a
    scale a row; a bias, one axis, stays float32)."""
    import paddle
    from plsc.quantized import quantize
    if dtype == "int8":  # the codes plsc chooses, their values computed here: code · scale / 127
        if a.ndim < 2:
            return a
        codes, scale = (t.numpy() for t in quantize(paddle.to_tensor(a)))
        return codes * (scale[:, None] / np.float32(127))
    return paddle.to_tensor(a).astype(dtype).astype("float32").numpy()


def storage_of(t):
    from plsc.storage import name as storage_name
    return storage_name(t)


def _run_head(margin, num_classes, ratio, chunk, dtype, w, b, x_local, y_local, **kw):
    """A head storing `w` (and `b`) as `dtype` (16 bits: values exactly representable in it;
    int8: quantised to nearest, a scale a row), after one forward and backward on this rank's
    batch: (head, loss, x leaf)."""
    import paddle
    from plsc.nn import PartialFC
    head = PartialFC(D, num_classes, margin, sample_ratio=ratio, seed=5, chunk_size=chunk,
                     param_dtype=dtype, **kw)
    lo, hi = head.class_start, head.class_start + head.num_local
    given = paddle.to_tensor(w[lo:hi])
    head.weight.set_value(given.astype(dtype) if dtype != "int8" else given)
    if b is not None:
        head.bias.set_value(paddle.to_tensor(b[lo:hi]).astype(storage_of(head.bias)))
    x = leaf(x_local)
    loss = head(x, paddle.to_tensor(y_local))
    loss.backward()
    return head, loss, x


def check_dtype_vs_float32(margin, num_classes, ratio, chunk, dtype):
    """A 16- or 8-bit head against the float32 head holding the same (stored) values: loss,
    embedding gradient and Partial FC's float32 sampled-row gradients within 1e-5; the dense
    16-bit weight gradient within half a 16-bit ulp (8 bits: float32, 1e-5); and the narrow
    head against the float64 dense oracle on the stored weights (restricted to the sampled
    classes)."""
    import paddle
    from oracles import compare, make_case, rel_err
    from plsc.distributed import gather_concat, get_rank, get_world_size

    rank, k = get_rank(), get_world_size()
    x, y, w_given, b = make_case(seed=num_classes * 11 + k + 1, n=k * B, d=D,
                                 num_classes=num_classes, margin=margin)
    w, b = rounded(w_given, dtype), (rounded(b, dtype) if b is not None else None)
    mine = slice(rank * B, (rank + 1) * B)
    h16, loss16, x16 = _run_head(margin, num_classes, ratio, chunk, dtype, w_given, b, x[mine],
                                 y[mine])
    h32, loss32, x32 = _run_head(margin, num_classes, ratio, chunk, "float32", w, b, x[mine],
                                 y[mine])
    sampled = ratio < 1.0
    shard = h16.partition.shard_size
    lo = h16.class_start
    flags = [storage_of(h16.weight) == dtype,
             b is None or storage_of(h16.bias) == (dtype if dtype != "int8" else "float32"),
             x16.grad.dtype == paddle.float32]
    if sampled:
        flags += [bool(paddle.equal_all(h16.sampled_index, h32.sampled_index)),
                  h16.sampled_weight.grad.dtype == paddle.float32]
    g = lambda h, name: gather_rows(h.row_gradient(name).astype("float32"),  # noqa: E731
                                    pad_to=shard)
    dw16, dw32 = g(h16, "weight"), g(h32, "weight")
    db16, db32 = (g(h16, "bias"), g(h32, "bias")) if b is not None else (None, None)
    losses = gather_rows(paddle.to_tensor([float(loss16), float(loss32)]).reshape([1, 2]))
    dx16, dx32 = gather_rows(x16.grad), gather_rows(x32.grad)
    flags_all = gather_concat(paddle.to_tensor([int(all(flags))], dtype="int64")).numpy()
    used = gather_rows(h16.sampled_index + lo, pad_to=shard) if sampled else np.arange(num_classes)
    if rank != 0:
        return None
    grad_tol = 1e-5 if sampled else HALF_ULP[dtype] + 1e-5  # dense: Paddle casts it to 16 bits
    errs = {
        "dtypes_and_sampling_ok_on_all_ranks": (float(len(flags_all) - flags_all.sum()), 0.0),
        "loss_vs_float32": (rel_err(losses[:, 0], losses[:, 1]), 1e-5),
        "loss_same_on_all_ranks": (float(np.ptp(losses[:, 0])), 0.0),
        "dx_vs_float32": (rel_err(dx16, dx32), 1e-5),
        "dw_vs_float32": (rel_err(dw16, dw32), grad_tol),
    }
    if b is not None:
        errs["db_vs_float32"] = (rel_err(db16, db32), grad_tol)
    remapped = np.searchsorted(used, y)
    assert np.array_equal(used[remapped], y), "a positive was not sampled"
    got = {"loss": float(losses[0, 0]), "dx": dx16, "dw": dw16}
    if b is not None:
        got["db"] = db16
    oracle = compare(got, x, remapped, w[used], margin, b[used] if b is not None else None)
    for key, (err, allowed) in oracle.items():
        errs["oracle_" + key] = (err, allowed if key in ("loss", "dx") else max(allowed, grad_tol))
    return errs


OPTIMIZERS = {
    "momentum": ("SparseMomentum", dict(learning_rate=0.1, momentum=0.9, weight_decay=5e-4)),
    "nesterov": ("SparseMomentum", dict(learning_rate=0.1, momentum=0.9, weight_decay=5e-4,
                                        use_nesterov=True)),
    "adamw": ("SparseAdamW", dict(learning_rate=0.01, weight_decay=0.1)),
}
FUSED_STEPS = 3


def fused_cases():
    """(optimizer, margin name, num_classes, sample_ratio, chunk_size, storage dtype)."""
    cases = [(opt, m, 101, r, k, "float32") for opt in ("momentum", "adamw")
             for m in ("arcface", "softmax") for r in (1.0, 0.5) for k in (0, 7)]
    cases += [("nesterov", "arcface", 101, 0.5, 7, "float32"),
              ("nesterov", "softmax", 23, 1.0, 0, "float32")]
    # 16-bit storage with Partial FC: the gathered rows' gradients are float32 either way.
    cases += [("momentum", "softmax", 101, 0.5, 7, "bfloat16"),
              ("adamw", "arcface", 101, 0.5, 0, "bfloat16"),
              ("momentum", "arcface", 101, 0.5, 0, "float16")]
    # 8-bit centres (and state): dense (the separate update reads the head's kept gradient),
    # chunked, sampled.
    cases += [("momentum", "arcface", 101, 1.0, 0, "int8"),
              ("adamw", "cosface", 101, 1.0, 7, "int8"),
              ("momentum", "softmax", 101, 0.5, 7, "int8"),
              ("adamw", "arcface", 101, 0.5, 0, "int8")]
    # Enough classes that 4,096-class slabs split a block (test_head_dtypes forces the wide-block
    # path for them: with D = 16 a block's gradient is far below the 64 MiB that takes it).
    cases += [("momentum", "arcface", 10000, 1.0, 0, "float32"),
              ("adamw", "softmax", 10000, 1.0, 6000, "float32"),
              ("momentum", "cosface", 10000, 0.5, 0, "float32")]
    return cases


def fused_case_name(opt, margin_name, num_classes, ratio, chunk, dtype):
    return f"fused-{opt}-{dtype}-" + case_name(margin_name, num_classes, ratio, chunk)


def _bits(t):
    """Raw bits of a tensor (an 8-bit array: its codes' bytes, then its scales'), for
    bit-for-bit comparison (NaN- and signed-zero-exact)."""
    if hasattr(t, "codes"):
        return np.concatenate([_bits(t.codes).reshape(-1).view(np.uint8),
                               _bits(t.scale).reshape(-1).view(np.uint8)])
    a = np.ascontiguousarray(np.asarray(t.numpy()))
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _differ(a, b):
    """Number of elements whose bits differ (shape or dtype mismatch: all of them, at least 1)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(1, a.size, b.size)
    return int((a != b).sum())


def check_fused_vs_separate(opt_name, margin, num_classes, ratio, chunk, dtype, sub_centers=1,
                            fresh_margin=None, head_kw=None):
    """`FUSED_STEPS` steps of the fused update (optimizer applied slab by slab inside the
    backward) against `backward(); opt.step(head)` on a second head: loss, embedding gradient,
    weight, bias and every optimizer state array bit for bit on every rank; and the fused
    backward leaves no weight (or bias, or sampled-row) gradient.

    Returns on rank 0 {key: [value on each rank]}: mismatching element counts per array,
    `fused_left_a_gradient` (fused backwards that left one) and `rows_unchanged` (1 if the
    steps did not change this rank's weight at all: a vacuous comparison).

    `sub_centers`: K rows per class (random centres); `fresh_margin`: a function returning a
    new margin for each head (a margin with state, e.g. AdaFace's statistics); `head_kw`: more
    PartialFC arguments (random centres too)."""
    import paddle
    import plsc.optim
    from oracles import make_case
    from plsc.distributed import gather_concat, get_rank, get_world_size
    from plsc.nn import PartialFC

    rank, k = get_rank(), get_world_size()
    kk = int(sub_centers)
    if kk == 1 and fresh_margin is None and not head_kw:
        _, _, w, b = make_case(seed=num_classes * 13 + k, n=k * B, d=D,
                               num_classes=num_classes, margin=margin)
    else:
        w = np.random.RandomState(num_classes * 13 + k).normal(
            0.0, 1.0, (num_classes * kk, D)).astype("float32")
        b = None
    if dtype != "float32":
        w, b = rounded(w, dtype), (rounded(b, dtype) if b is not None else None)
    rng = np.random.RandomState(num_classes + 17 * k)
    cls_name, kw = OPTIMIZERS[opt_name]
    heads, opts = [], []
    for _ in range(2):  # fused, separate
        more = dict(head_kw or {}, **({"sub_centers": kk} if kk != 1 else {}))
        head = PartialFC(D, num_classes, fresh_margin() if fresh_margin else margin,
                         sample_ratio=ratio, seed=9, chunk_size=chunk, param_dtype=dtype,
                         **more)
        lo, hi = head.class_start, head.class_start + head.num_local
        head.weight.set_value(paddle.to_tensor(w[lo * kk:hi * kk]).astype(
            dtype if dtype != "int8" else "float32"))
        if b is not None:
            head.bias.set_value(paddle.to_tensor(b[lo:hi]).astype(storage_of(head.bias)))
        heads.append(head)
        opts.append(getattr(plsc.optim, cls_name)(seed=3, **kw))
    fused, separate = heads
    opt_f, opt_s = opts
    start = _bits(fused.weight).copy()
    counts = {}

    def add(key, n):
        counts[key] = counts.get(key, 0) + n

    left_grad = 0
    for _ in range(FUSED_STEPS):
        xs = (rng.normal(0.0, 1.0, (k * B, D)) * 3.0).astype("float32")
        ys = rng.randint(0, num_classes, k * B).astype("int64")
        mine = slice(rank * B, (rank + 1) * B)
        y_local = paddle.to_tensor(ys[mine])
        fused.row_update = opt_f.fused_update(fused)
        xf = leaf(xs[mine])
        loss_f = fused(xf, y_local)
        loss_f.backward()
        grads = [fused.row_gradient("weight"),
                 fused.row_gradient("bias") if b is not None else None]
        if ratio < 1.0:
            grads += [getattr(fused.weight, "grad", None),
                      fused.bias.grad if b is not None else None]
        left_grad += int(any(gr is not None for gr in grads))
        opt_f.end_fused_step(fused)
        fused.row_update = None
        x_s = leaf(xs[mine])
        loss_s = separate(x_s, y_local)
        loss_s.backward()
        opt_s.step(separate)
        add("loss", _differ(_bits(loss_f), _bits(loss_s)))
        add("dx", _differ(_bits(xf.grad), _bits(x_s.grad)))
    add("weight", _differ(_bits(fused.weight), _bits(separate.weight)))
    if b is not None:
        add("bias", _differ(_bits(fused.bias), _bits(separate.bias)))
    state_f, state_s = opt_f.state_dict(), opt_s.state_dict()
    expect = {"weight." + s for s in opt_s.state_names}
    if b is not None:
        expect |= {"bias." + s for s in opt_s.state_names}
    add("state_arrays_missing", len(expect - set(state_s)) + len(set(state_f) ^ set(state_s)))
    for key in sorted(expect):
        if key in state_f and key in state_s:
            add("state." + key, _differ(_bits(state_f[key]), _bits(state_s[key])))
    for key in ("weight.steps", "bias.steps", "step_count"):
        if key in state_f and key in state_s:
            add("state." + key, _differ(_bits(state_f[key]), _bits(state_s[key])))
    add("step_count", int(opt_f.step_count != opt_s.step_count or opt_f.step_count != FUSED_STEPS))
    counts["fused_left_a_gradient"] = left_grad
    counts["rows_unchanged"] = int(np.array_equal(_bits(fused.weight), start))
    keys = sorted(counts)  # the same keys on every rank
    table = gather_concat(paddle.to_tensor([counts[key] for key in keys], dtype="int64"))
    table = table.numpy().reshape([k, len(keys)])
    if rank != 0:
        return None
    return {key: table[:, i].tolist() for i, key in enumerate(keys)}


def fused_failures(result):
    """{key: counts per rank} of a `check_fused_vs_separate` report that are not all 0."""
    return {key: counts for key, counts in result.items() if any(counts)}


# ---- AdaFace and sub-centres (issue 13)

# (margin name, num_classes, sample_ratio, chunk_size, sub_centers, tied classes); 23 and 101
# are divisible by none of 2, 3, 4: uneven splits in every group.
SUBCENTER_CASES = (
    ("arcface", 23, 1.0, 0, 2, (1, 7, 16)),
    ("arcface", 23, 1.0, 3, 2, (1, 7, 16)),
    ("cosface", 101, 0.5, 0, 3, (0, 55, 100)),
)
# (num_classes, sample_ratio, chunk_size, scale)
ADAFACE_CASES = ((23, 1.0, 0, 16.0), (23, 1.0, 4, 16.0), (101, 0.5, 0, 16.0))


def subcenter_case_name(margin_name, num_classes, ratio, chunk, k):
    return f"subcenters{k}-" + case_name(margin_name, num_classes, ratio, chunk)


def adaface_case_name(num_classes, ratio, chunk, s):
    return f"adaface-s{s:g}-" + case_name("clamps", num_classes, ratio, chunk)


def run_head_step(margin, num_classes, x, y, w, ratio=1.0, chunk=0, sub_centers=1, setup=None,
                  train=True, **head_kw):
    """One forward and backward of a PartialFC on this group, every rank holding the global
    batch `x, y` and the full `w: [C·K, d]` (class-major). Returns (head, got, used, losses):
    got = {loss, dx, dw} gathered over the ranks (dw: the sampled classes' rows with Partial
    FC), used = the global classes whose rows dw holds, losses = each rank's loss. `head_kw`:
    more PartialFC arguments."""
    import paddle
    from plsc.distributed import get_rank, get_world_size
    from plsc.nn import PartialFC

    rank, k = get_rank(), get_world_size()
    kk = int(sub_centers)
    kw = dict(head_kw, **({"sub_centers": kk} if kk != 1 else {}))
    head = PartialFC(x.shape[1], num_classes, margin, sample_ratio=ratio, seed=5,
                     chunk_size=chunk, **kw)
    head.train() if train else head.eval()
    lo, hi = head.class_start, head.class_start + head.num_local
    head.weight.set_value(w[lo * kk:hi * kk])
    if setup is not None:
        setup(head)
    b = x.shape[0] // k
    x_local = leaf(x[rank * b:(rank + 1) * b])
    loss = head(x_local, paddle.to_tensor(y[rank * b:(rank + 1) * b]))
    loss.backward()
    losses = gather_rows(paddle.to_tensor([float(loss)]))
    dx = gather_rows(x_local.grad)
    shard = head.partition.shard_size
    sampled = ratio < 1.0
    w_rows = head.sampled_weight if sampled else head.weight
    dw = gather_rows(w_rows.grad, pad_to=shard * kk)
    used = gather_rows(head.sampled_index + lo, pad_to=shard) if sampled \
        else np.arange(num_classes)
    return head, {"loss": float(loss), "dx": dx, "dw": dw}, used, losses


def _restricted(used, y, w, sub_centers):
    """Labels remapped into the sampled classes `used`, and those classes' rows of `w`."""
    from oracles import class_rows
    remapped = np.searchsorted(used, y)
    assert np.array_equal(used[remapped], y), "a positive was not sampled"
    return remapped, w[class_rows(used, sub_centers)]


def set_adaface_stats(mean, std):
    import paddle

    def setup(head):
        for buf, v in ((head.margin.batch_mean, mean), (head.margin.batch_std, std)):
            buf.set_value(paddle.full(buf.shape, v, dtype="float32"))
    return setup


def adaface_stats(head):
    return [float(head.margin.batch_mean.numpy().reshape([-1])[0]),
            float(head.margin.batch_std.numpy().reshape([-1])[0])]


def check_adaface_clamps(num_classes, ratio=1.0, chunk=0, s=16.0, m=0.4, n=None):
    """AdaFace (training step) on data hitting every clamp (oracles.make_adaface_case; needs
    a global batch of >= 10) vs the float64 oracle, restricted to the sampled classes; the
    updated statistics vs the formula, the same on every rank. Returns errs on rank 0."""
    import paddle
    from oracles import (ADA_CLAMP_STATS, AdaFaceOracle, adaface_clamp_hits, compare_oracle,
                         make_adaface_case, rel_err, row_rel_err, oracle_reference)
    from plsc.distributed import get_rank, get_world_size
    from plsc.loss import AdaFace

    rank, k = get_rank(), get_world_size()
    x, y, w, _ = make_adaface_case(seed=num_classes + 31 * k, n=n or k * B, d=D,
                                   num_classes=num_classes)
    st = ADA_CLAMP_STATS
    margin = AdaFace(s=s, m=m, h=st["h"], t_alpha=st["t_alpha"])
    head, got, used, losses = run_head_step(
        margin, num_classes, x, y, w, ratio, chunk,
        setup=set_adaface_stats(st["batch_mean"], st["batch_std"]))
    stats = gather_rows(paddle.to_tensor([adaface_stats(head)], dtype="float64"))
    if rank != 0:
        return None
    oracle = AdaFaceOracle(s=s, m=m, **st).update(x)
    q = oracle.q(x)
    remapped, w_used = _restricted(used, y, w, 1)
    hits = adaface_clamp_hits(x, remapped, w_used, oracle)  # among the sampled classes
    errs = compare_oracle(got, x, remapped, w_used, oracle, 1, q)
    ref = oracle_reference(x, remapped, w_used, oracle, 1, q)
    errs["dx_per_row"] = (row_rel_err(got["dx"], ref["dx"]), 1e-5)
    errs["loss_same_on_all_ranks"] = (float(np.ptp(losses)), 0.0)
    errs["stats_same_on_all_ranks"] = (float(np.ptp(stats, axis=0).max()), 0.0)
    errs["batch_mean"] = (rel_err(stats[0, 0], oracle.batch_mean), 1e-6)
    errs["batch_std"] = (rel_err(stats[0, 1], oracle.batch_std), 1e-6)
    # The data's coverage (float64): each clamp hit at least once (norm_below: tiny case).
    missed = [key for key, n in hits.items() if n == 0 and key != "norm_below"]
    errs["clamps_missed"] = (float(len(missed)), 0.0)
    return errs


def check_subcenters(margin, num_classes, ratio, chunk, sub_centers, ties, n=None):
    """Sub-centres (K rows per class, classes `ties` with K identical rows) vs the float64
    oracle (max over centres by argmax + gather: ties to the first centre)."""
    from oracles import compare_oracle, make_subcenter_case
    from plsc.distributed import get_rank, get_world_size

    rank, k = get_rank(), get_world_size()
    x, y, w = make_subcenter_case(seed=num_classes + 5 * sub_centers + 17 * k, n=n or k * B,
                                  d=D, num_classes=num_classes, sub_centers=sub_centers,
                                  margin=margin, ties=ties)
    head, got, used, losses = run_head_step(margin, num_classes, x, y, w, ratio, chunk,
                                            sub_centers)
    if rank != 0:
        return None
    remapped, w_used = _restricted(used, y, w, sub_centers)
    errs = compare_oracle(got, x, remapped, w_used, margin, sub_centers)
    errs["loss_same_on_all_ranks"] = (float(np.ptp(losses)), 0.0)
    # The tied classes' second..K-th rows get no gradient (exactly 0).
    tied = [np.searchsorted(used, c) for c in ties if c in used]
    rest = [got["dw"][j * sub_centers + 1:(j + 1) * sub_centers] for j in tied]
    errs["tied_rest_grad"] = (float(max(np.abs(r).max() for r in rest)) if rest else 0.0, 0.0)
    errs["tied_first_grad_nonzero"] = (float(sum(not np.abs(got["dw"][j * sub_centers]).max()
                                                 for j in tied)), 0.0)
    return errs


ADAFACE_STEP_BATCHES = 3


def check_adaface_steps(num_classes=23, b=B):
    """Three training steps with different batches (ρ = 1): the statistics after each equal
    the formula's (and are the same on every rank); then in eval mode a forward leaves them
    bit for bit, and its loss and gradients are the oracle's with those statistics."""
    import paddle
    from oracles import AdaFaceOracle, compare_oracle, rel_err
    from plsc.distributed import get_rank, get_world_size
    from plsc.loss import AdaFace
    from plsc.nn import PartialFC

    rank, k = get_rank(), get_world_size()
    rng = np.random.RandomState(7 + k)
    n = k * b
    w = rng.normal(0.0, 1.0, (num_classes, D)).astype("float32")
    batches = [((rng.normal(0.0, 1.0, (n, D)) * rng.uniform(0.5, 6.0 + 20 * i, (n, 1)))
                .astype("float32"), rng.randint(0, num_classes, n).astype("int64"))
               for i in range(ADAFACE_STEP_BATCHES + 1)]
    params = dict(s=16.0, m=0.4, h=0.333, t_alpha=0.3)
    head = PartialFC(D, num_classes, AdaFace(**params), seed=5)
    lo, hi = head.class_start, head.class_start + head.num_local
    head.weight.set_value(w[lo:hi])
    mine = slice(rank * b, (rank + 1) * b)
    rows = []
    for i, (x, y) in enumerate(batches):
        if i == ADAFACE_STEP_BATCHES:
            head.eval()
        before = adaface_stats(head)
        xt = leaf(x[mine])
        loss = head(xt, paddle.to_tensor(y[mine]))
        loss.backward()
        rows.append(gather_rows(paddle.to_tensor([adaface_stats(head) + [float(loss)]],
                                                 dtype="float64")))
        dx = gather_rows(xt.grad)
        dw = gather_rows(head.weight.grad, pad_to=head.partition.shard_size)
        head.clear_gradients()
    if rank != 0:
        return None
    oracle = AdaFaceOracle(**params)
    errs = {}
    for i, (x, y) in enumerate(batches):
        errs[f"step{i}_same_on_all_ranks"] = (float(np.ptp(rows[i], axis=0).max()), 0.0)
        if i < ADAFACE_STEP_BATCHES:
            oracle.update(x)
            errs[f"step{i}_batch_mean"] = (rel_err(rows[i][0, 0], oracle.batch_mean), 1e-6)
            errs[f"step{i}_batch_std"] = (rel_err(rows[i][0, 1], oracle.batch_std), 1e-6)
    x, y = batches[-1]
    errs["eval_keeps_stats"] = (float(before != rows[-1][0, :2].tolist()), 0.0)
    for key, v in compare_oracle({"loss": float(rows[-1][0, 2]), "dx": dx, "dw": dw}, x, y, w,
                                 oracle, 1, oracle.q(x)).items():
        errs["eval_" + key] = v
    return errs


# ---- Inter-class filtering (issue 23)

# Low enough that the unfiltered logits (at most s·t for the non-targets) leave the filtered
# entries' exp(0 − max) a visible share of the softmax: at s = 64, t = 0.25 it is ~e^-16, and a
# filtered entry that wrongly passed gradient would hide under the float32 tolerance.
FILTER_THRESHOLD = 0.1
# (margin name, num_classes, sample_ratio, chunk_size, sub_centers): Partial FC, the chunked
# head with sub-centres, AdaFace (its clamp and the filter in one mask); uneven splits.
FILTER_CASES = (("arcface", 101, 0.5, 0, 1), ("cosface", 23, 1.0, 3, 2),
                ("adaface", 23, 1.0, 0, 1))
FILTER_EFFECT = 100.0  # filtering must move each result by this many times its tolerance


def filter_case_name(margin_name, num_classes, ratio, chunk, k):
    return f"filter{FILTER_THRESHOLD:g}-" + (f"k{k}-" if k > 1 else "") + \
        case_name(margin_name, num_classes, ratio, chunk)


def check_filtered(margin_name, num_classes, ratio=1.0, chunk=0, sub_centers=1,
                   threshold=FILTER_THRESHOLD, n=None, seed=0):
    """The head with `interclass_filtering_threshold` vs the float64 oracle (the rule written
    from arcface_torch's definition, restricted to the sampled classes), on data where every
    rank's (sampled) classes hold filtered entries, some targets are above the threshold (they
    must not be filtered) and the filter moves loss and gradients far beyond the tolerance.
    Returns errs on rank 0 ({key: (value, allowed)})."""
    from oracles import (ADAFACE_PUBLISHED, FILTER_GAP, AdaFaceOracle, class_cosines,
                         compare_oracle, filtered_mask, make_conflict_case, oracle_reference,
                         rel_err)
    from plsc.distributed import get_rank, get_world_size
    from plsc.loss import AdaFace

    rank, k = get_rank(), get_world_size()
    kk = int(sub_centers)
    x, y, w = make_conflict_case(seed=seed + num_classes + 3 * kk + 11 * k, n=n or k * B, d=D,
                                 num_classes=num_classes, threshold=threshold, sub_centers=kk,
                                 antiparallel=margin_name == "adaface")
    if margin_name == "adaface":
        margin = AdaFace(**ADAFACE_PUBLISHED)  # in training mode: statistics from this batch
    else:
        margin = margins()[margin_name]
    head, got, used, losses = run_head_step(margin, num_classes, x, y, w, ratio, chunk, kk,
                                            interclass_filtering_threshold=threshold)
    if rank != 0:
        return None
    q = None
    if margin_name == "adaface":
        margin = AdaFaceOracle(**ADAFACE_PUBLISHED).update(x)
        q = margin.q(x)
    remapped, w_used = _restricted(used, y, w, kk)
    errs = compare_oracle(got, x, remapped, w_used, margin, kk, q, filter_threshold=threshold)
    errs["loss_same_on_all_ranks"] = (float(np.ptp(losses)), 0.0)
    # The data (float64, from the test's arrays): filtered entries on every rank's share of
    # the classes used (rank r owns [r·shard, min((r+1)·shard, C)), shard = ceil(C/k)), targets
    # above the threshold, no cosine near it.
    cos = class_cosines(x, w_used, kk)
    dirty = filtered_mask(x, remapped, w_used, threshold, kk)
    shard = -(-num_classes // k)
    per_rank = [int(dirty[:, (used >= r * shard) & (used < (r + 1) * shard)].sum())
                for r in range(k)]
    errs["ranks_without_filtered_entries"] = (float(sum(c == 0 for c in per_rank)), 0.0)
    above = int((cos[np.arange(len(y)), remapped] > threshold).sum())
    errs["no_target_above_threshold"] = (float(above == 0), 0.0)
    errs["cosines_near_threshold"] = (float((np.abs(cos - threshold) <= FILTER_GAP).sum()), 0.0)
    # The filter's effect on each result, against its tolerance: a head that did not filter
    # lands that far from the oracle, and so does one whose filtered entries pass gradient.
    ref = oracle_reference(x, remapped, w_used, margin, kk, q, filter_threshold=threshold)
    plain = oracle_reference(x, remapped, w_used, margin, kk, q)
    leaky = oracle_reference(x, remapped, w_used, margin, kk, q, filter_threshold=threshold,
                             filter_leaks=True)
    for name, other, keys in (("effect", plain, ("loss", "dx", "dw")),
                              ("leak", leaky, ("dx", "dw"))):
        for key in keys:
            effect = rel_err(other[key], ref[key])
            errs[f"tolerance_x{FILTER_EFFECT:g}_over_{name}_{key}"] = (
                FILTER_EFFECT * errs[key][1] / max(effect, 1e-300), 1.0)
    return errs


DEVICE = "device:"  # the report's prefix of the cases run on the device kernel set


def run(out_path):
    import paddle
    import plsc.distributed as pd
    paddle.set_device("cpu")
    pd.init()
    results = {"world_size": pd.get_world_size(), "backend": pd.get_backend()}
    cases = [("collectives", check_collectives), ("bad_input", check_bad_input)]
    for name, margin, c, ratio, chunk in oracle_cases():
        cases.append((case_name(name, c, ratio, chunk),
                      lambda m=margin, c=c, r=ratio, k=chunk: check_against_oracles(m, c, r, k)))
    ms = margins()
    for dt, name, c, ratio, chunk in dtype_cases():
        cases.append((dtype_case_name(dt, name, c, ratio, chunk),
                      lambda m=ms[name], c=c, r=ratio, k=chunk, dt=dt:
                      check_dtype_vs_float32(m, c, r, k, dt)))
    for opt, name, c, ratio, chunk, dt in fused_cases():
        cases.append((fused_case_name(opt, name, c, ratio, chunk, dt),
                      lambda o=opt, m=ms[name], c=c, r=ratio, k=chunk, dt=dt:
                      check_fused_vs_separate(o, m, c, r, k, dt)))
    for name, c, ratio, chunk, kk, ties in SUBCENTER_CASES:
        cases.append((subcenter_case_name(name, c, ratio, chunk, kk),
                      lambda m=ms[name], c=c, r=ratio, ch=chunk, kk=kk, t=ties:
                      check_subcenters(m, c, r, ch, kk, t)))
    for c, ratio, chunk, s in ADAFACE_CASES:
        cases.append((adaface_case_name(c, ratio, chunk, s),
                      lambda c=c, r=ratio, ch=chunk, s=s: check_adaface_clamps(c, r, ch, s)))
    cases.append(("adaface-steps", check_adaface_steps))
    for name, c, ratio, chunk, kk in FILTER_CASES:
        cases.append((filter_case_name(name, c, ratio, chunk, kk),
                      lambda m=name, c=c, r=ratio, ch=chunk, kk=kk:
                      check_filtered(m, c, r, ch, kk)))
    # The head's oracle cases again on the device kernel set (Paddle ops only, what a GPU
    # runs), in the same ranks: reported as DEVICE + name.
    device = [(DEVICE + name, fn) for name, fn in cases
              if not name.startswith(("collectives", "bad_input"))
              and not name.startswith("fused")]
    outer = os.environ.get("PLSC_KERNELS")
    for name, fn in cases + device:
        if name.startswith(DEVICE):
            os.environ["PLSC_KERNELS"] = "device"
        try:
            results[name] = fn()
        except Exception:  # recorded, so one failing case does not hide the others
            results[name] = {"error": traceback.format_exc()}
        finally:
            if outer is None:
                os.environ.pop("PLSC_KERNELS", None)
            else:
                os.environ["PLSC_KERNELS"] = outer
    if pd.get_rank() == 0:
        with open(out_path + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--nprocs", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import paddle.distributed as dist
    dist.spawn(run, args=(args.out,), nprocs=args.nprocs)
