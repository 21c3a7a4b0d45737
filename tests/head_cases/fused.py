"""The fused update (the optimizer applied slab by slab inside the backward) against
`backward(); opt.step(head)`, bit for bit on every rank."""
import numpy as np

from head_cases.common import B, D, case_name, leaf
from head_cases.dtypes import rounded, storage_of

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
    # Enough classes that 4,096-class slabs split a block (dtypes/test_head.py forces the
    # wide-block path for them: with D = 16 a block's gradient is far below the 8 MiB that
    # takes it).
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
