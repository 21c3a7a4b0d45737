"""What every case family of the head's multi-rank cases shares: the sizes, the named
margins, case names, gathering a tensor from every rank, and one head step on a group."""
import numpy as np

from oracles import published_margin

B, D = 5, 16  # per-rank batch and embedding width


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


def leaf(a):
    import paddle
    t = paddle.to_tensor(a)
    t.stop_gradient = False
    return t


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


def restricted(used, y, w, sub_centers):
    """Labels remapped into the sampled classes `used`, and those classes' rows of `w`."""
    from oracles import class_rows
    remapped = np.searchsorted(used, y)
    assert np.array_equal(used[remapped], y), "a positive was not sampled"
    return remapped, w[class_rows(used, sub_centers)]
