"""Margins with more than one row or with state (issue 13): sub-centres (K rows per class,
ties between them) and AdaFace (every clamp, its running statistics over steps and in eval
mode), against the float64 oracle."""
import numpy as np

from head_cases.common import B, D, case_name, gather_rows, leaf, restricted, run_head_step

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
    remapped, w_used = restricted(used, y, w, 1)
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
    remapped, w_used = restricted(used, y, w, sub_centers)
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
