"""The head against the dense float64 oracle (restricted to the sampled classes with Partial
FC) and, unsampled, against PLSC's own steps simulated rank by rank (`plsc_literal`)."""
import numpy as np

from oracles import margin_params

from head_cases.common import B, D, gather_rows, leaf, margins, run_head_step

CLASS_COUNTS = (10, 23, 101)
SAMPLED = (("arcface", 101, 0.5), ("softmax", 101, 0.5), ("cosface", 23, 0.3))
CHUNKED = (("arcface", 101, 1.0, 7), ("softmax", 23, 1.0, 3), ("combined", 23, 1.0, 2),
           ("cosface", 101, 0.5, 5))  # (margin, classes, sample ratio, chunk size)


def oracle_cases():
    """(margin name, margin, num_classes, sample_ratio, chunk_size) of every oracle case."""
    ms = margins()
    cases = [(name, m, c, 1.0, 0) for c in CLASS_COUNTS for name, m in ms.items()]
    cases += [(name, ms[name], c, r, 0) for name, c, r in SAMPLED]
    return cases + [(name, ms[name], c, r, k) for name, c, r, k in CHUNKED]


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


def check_against_oracles(margin, num_classes, ratio=1.0, chunk=0):
    """The head on this group vs the dense oracle (restricted to the sampled classes when
    ratio < 1) on rank 0 and, at ratio 1, vs the PLSC-literal steps on every rank."""
    import paddle
    from oracles import compare, make_case, rel_err
    from plsc.distributed import get_rank, get_world_size

    rank, k = get_rank(), get_world_size()
    x, y, w, b = make_case(seed=num_classes * 7 + k, n=k * B, d=D, num_classes=num_classes,
                           margin=margin)
    set_bias = None if b is None else (
        lambda head: head.bias.set_value(b[head.class_start:head.class_start + head.num_local]))
    head, got, used, losses = run_head_step(margin, num_classes, x, y, w, ratio, chunk, setup=set_bias)
    sampled = ratio < 1.0
    if b is not None:
        b_rows = head.sampled_bias if sampled else head.bias
        got["db"] = gather_rows(b_rows.grad, pad_to=head.partition.shard_size)

    lit_worst = None
    if not sampled:  # Oracle 2 on every rank, compared rank by rank.
        literal = plsc_literal(x, y, w, b, margin, num_classes, k)
        lit = {
            "loss": rel_err([got["loss"]], [literal["loss"]]),
            "dx": rel_err(got["dx"][rank * B:(rank + 1) * B], literal["dx"][rank]),  # this rank's rows
            "dw": rel_err(head.weight.grad.numpy(), literal["dw"][rank]),
        }
        if b is not None:
            lit["db"] = rel_err(head.bias.grad.numpy(), literal["db"][rank])
        lit_worst = gather_rows(paddle.to_tensor([max(lit.values())], dtype="float64"))

    if rank != 0:
        return None
    remapped = np.searchsorted(used, y)
    assert np.array_equal(used[remapped], y), "a positive was not sampled"
    errs = compare(got, x, remapped, w[used], margin, b[used] if b is not None else None)
    errs["loss_same_on_all_ranks"] = (float(np.ptp(losses)), 0.0)
    if lit_worst is not None:
        errs["plsc_literal"] = (float(lit_worst.max()), 1e-5)
    return errs
