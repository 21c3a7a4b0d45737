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

B, D = 5, 16  # per-rank batch and embedding width
CLASS_COUNTS = (10, 23, 101)
SAMPLED = (("arcface", 101, 0.5), ("softmax", 101, 0.5), ("cosface", 23, 0.3))
CHUNKED = (("arcface", 101, 1.0, 7), ("softmax", 23, 1.0, 3), ("combined", 23, 1.0, 2),
           ("cosface", 101, 0.5, 5))  # (margin, classes, sample ratio, chunk size)


def margins():
    from plsc.loss import ArcFace, CombinedMargin, CosFace, Softmax, SphereFace
    return {
        "arcface": ArcFace(),
        "arcface_st": ArcFace(straight_through=True),
        "cosface": CosFace(),
        "sphereface": SphereFace(),
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


def plsc_literal(x_local, labels, w_local, b_local, margin, num_classes):
    """PLSC's steps, each a Paddle op with autograd: gather, shard_index, MAX/SUM,
    the min trick on log p ⊙ onehot and a reduce-scatter of the loss. Run in
    float64 so that it measures the head's fp32 error, not its own."""
    import paddle
    import paddle.distributed as dist
    import paddle.nn.functional as F
    from paddle.autograd import PyLayer
    from plsc.distributed import all_gather, gather_concat, reduce_scatter

    class AllReduceSum(PyLayer):
        @staticmethod
        def forward(ctx, t):
            t = t.clone()
            dist.all_reduce(t)
            return t

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            dist.all_reduce(g)
            return g

    rank, k = dist.get_rank(), dist.get_world_size()
    n_local = w_local.shape[0]
    x = all_gather(x_local)
    y = gather_concat(labels)
    shard_label = paddle.shard_index(y.unsqueeze(1), num_classes, k, rank, ignore_value=-1)
    shard_label = paddle.where(shard_label < 0, paddle.full_like(shard_label, n_local), shard_label)
    onehot = F.one_hot(shard_label.squeeze(1), n_local + 1)[:, :n_local].astype(x.dtype)
    if margin.normalized:
        cos = paddle.matmul(F.normalize(x, axis=1), F.normalize(w_local, axis=1), transpose_y=True)
        cos = paddle.clip(cos, -1.0, 1.0)
        s = margin.scale
        target = s * (paddle.cos(margin.m1 * paddle.acos(cos) + margin.m2) - margin.m3)
        if margin.straight_through:
            target = s * cos + (target - s * cos).detach()
        logits = onehot * target + (1.0 - onehot) * s * cos
    else:
        logits = paddle.matmul(x, w_local, transpose_y=True) + b_local
    row_max = logits.max(axis=1, keepdim=True).detach()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX)
    shifted = logits - row_max
    sum_exp = AllReduceSum.apply(paddle.exp(shifted).sum(axis=1, keepdim=True))
    log_prob = shifted - paddle.log(sum_exp)
    target_log_prob = (log_prob * onehot).min(axis=1)
    local_loss = reduce_scatter(-target_log_prob)
    return local_loss.sum() / (k * x_local.shape[0])


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
    from plsc.distributed import all_reduce_, get_rank, get_world_size
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
        f64 = lambda a: leaf(np.asarray(a, dtype="float64"))  # noqa: E731
        x2, w2 = f64(x[rank * B:(rank + 1) * B]), f64(w[lo:hi])
        b2 = f64(b[lo:hi]) if b is not None else None
        literal = plsc_literal(x2, y_local, w2, b2, margin, num_classes)
        literal.backward()
        literal_loss = float(all_reduce_(literal.detach().clone(), "sum"))
        lit = {
            "loss": rel_err([literal_loss], [float(loss)]),
            "dx": rel_err(x_local.grad.numpy(), x2.grad.numpy()),
            "dw": rel_err(head.weight.grad.numpy(), w2.grad.numpy()),
        }
        if b is not None:
            lit["db"] = rel_err(head.bias.grad.numpy(), b2.grad.numpy())
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
    """all_gather / reduce_scatter forward and backward against their definitions."""
    import paddle
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
    z = leaf(np.full((2 * k, 3), rank + 1.0, dtype="float32"))
    rs = reduce_scatter(z)
    (rs * (rank + 1)).sum().backward()
    ok = {
        "all_gather_forward": bool(np.array_equal(g.numpy(), full)),
        "all_gather_backward": bool(np.allclose(x.grad.numpy(), expect_grad)),
        "reduce_scatter_forward": bool(np.allclose(rs.numpy(), k * (k + 1) / 2)),
        "reduce_scatter_backward": bool(np.allclose(
            z.grad.numpy(), np.repeat(np.arange(1, k + 1, dtype="float32"), 2)[:, None] * np.ones(3))),
    }
    return ok if rank == 0 else None


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
    for name, fn in cases:
        try:
            results[name] = fn()
        except Exception:  # recorded, so one failing case does not hide the others
            results[name] = {"error": traceback.format_exc()}
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
