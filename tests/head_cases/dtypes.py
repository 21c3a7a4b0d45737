"""16-bit and 8-bit storage: the narrow head against the float32 head holding the same
stored values, and against the float64 oracle on them."""
import numpy as np

from head_cases.common import B, D, case_name, gather_rows, leaf

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
    from plsc.storage.int8 import quantize
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
