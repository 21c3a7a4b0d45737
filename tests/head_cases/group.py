"""The group itself: plsc's collectives against their definitions, and bad input on one rank
raising the same error on every rank."""
import json
import zlib

import numpy as np

from head_cases.common import B, D, leaf


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
