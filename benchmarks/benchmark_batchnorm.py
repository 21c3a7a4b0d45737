"""Is Paddle's CPU BatchNorm worth replacing? Paddle 3.3's `batch_norm` (NCHW float32, training
forward and backward) beside the kernels plsc could run instead, at IResNet's shapes; and a
backbone's BatchNorm forward time step by step. One JSON document.

    python benchmarks/benchmark_batchnorm.py                  # 1 thread, the thread's CPU time
    python benchmarks/benchmark_batchnorm.py --threads 2 --clock wall
    python benchmarks/benchmark_batchnorm.py --steps 6 --shapes   # IResNet18's BN per step only

Candidates (each checked against Paddle's output and gradients: the largest error relative to
the largest value, in "error"):
- onednn_blocked: oneDNN's jit batch normalization (Paddle's bundled libdnnl.so.3 through
  `plsc.kernels.onednn.library`) on channels in blocks of the vector width, the inputs reordered into
  that layout and the result back (in place in `library.SCRATCH`'s slots, as a layer would);
- onednn_plain: oneDNN's batch normalization on the plain NCHW memory (its generic kernel);
- numpy: the statistics per row (one image's channel) in L2-sized slabs, two-pass within a
  row and combined per channel in float64; the output and the data gradient one multiply-add
  per slab.
Every repeat runs each kernel once (interleaved), medians reported, in ms (forward, backward).
`--clock cpu` (the default with one thread) is the calling thread's CPU time
(`time.thread_time`: Paddle's, oneDNN's and numpy's work on one thread runs on it), which other
processes' load on a shared machine does not inflate; `wall` is `time.perf_counter`. The set-up
is a run's (`runtime.select_device`): the threads given, malloc keeping freed memory.

`--steps N`: IResNet18 at batch 32 and 112 px, N
training steps; each step's seconds and those of its BatchNorm2D forwards (forward hooks),
wall and the calling thread's CPU time, and the minor page faults (first touches of memory).
"""
import argparse
import ctypes
import json
import os
import resource
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ([32, 64, 112, 112], [32, 64, 56, 56], [32, 128, 28, 28], [32, 256, 14, 14],
          [32, 512, 7, 7])
EPS = 1e-5
SLAB = 1 << 16  # floats of a numpy slab (256 KiB)


class OneDNNBatchNorm:
    """oneDNN's training forward and backward of one NCHW shape, on channels in blocks
    (`blocked`) or on the plain layout."""

    def __init__(self, shape, blocked):
        from plsc.kernels.onednn import library as L
        self.L = L
        lib = L.lib()
        vp, c_float, c_uint, c_int = L.vp, ctypes.c_float, ctypes.c_uint, ctypes.c_int
        fwd_create = lib.dnnl_batch_normalization_forward_primitive_desc_create
        fwd_create.argtypes = [ctypes.POINTER(vp), vp, c_int, vp, vp, c_float, c_uint, vp]
        bwd_create = lib.dnnl_batch_normalization_backward_primitive_desc_create
        bwd_create.argtypes = [ctypes.POINTER(vp), vp, c_int, vp, vp, vp, c_float, c_uint, vp,
                               vp]
        lib.dnnl_get_effective_cpu_isa.restype = c_int
        tag = L.TAG_ABCD
        if blocked:  # 16 floats a block where oneDNN runs AVX-512 (the dnnl_cpu_isa_t bit)
            tag = 78 if lib.dnnl_get_effective_cpu_isa() & 0x20 else 102
            assert lib.dnnl_fmt_tag2str(tag) in (b"aBcd16b", b"aBcd8b")
        plain, inner, stat = L.md(shape, L.TAG_ABCD), L.md(shape, tag), L.md(shape[1:2], L.TAG_A)
        flags = L.USE_SCALE | L.USE_SHIFT
        fwd_pd, bwd_pd = vp(), vp()
        L.ok(fwd_create(ctypes.byref(fwd_pd), L.engine(), L.FORWARD_TRAINING, inner, inner, EPS,
                        flags, None), "batch_normalization_forward")
        L.ok(bwd_create(ctypes.byref(bwd_pd), L.engine(), L.BACKWARD, inner, inner, inner, EPS,
                        flags, fwd_pd, None), "batch_normalization_backward")
        self.fwd, self.bwd = L.primitive(fwd_pd), L.primitive(bwd_pd)
        # x and the output share slot "a", dy and dx slot "b": the primitives run in place
        self.src, self.dst = L.Arg(plain, inner, True, "a"), L.Arg(plain, inner, False, "a")
        self.diff_dst, self.diff_src = L.Arg(plain, inner, True, "b"), \
            L.Arg(plain, inner, False, "b")
        self.stat = {a: L.memory(stat) for a in (L.ARG_MEAN, L.ARG_VARIANCE, L.ARG_SCALE,
                                                 L.ARG_SHIFT, L.ARG_DIFF_SCALE, L.ARG_DIFF_SHIFT)}

    def _stats(self, ptrs):
        for arg, ptr in ptrs.items():
            self.L.set_handle(self.stat[arg], ptr)
        return [(arg, self.stat[arg]) for arg in ptrs]

    def forward(self, x, w, b, y, mean, var):
        L = self.L
        self.src.stage_in(x)
        self.dst.bind_out(y)
        L.execute(self.fwd, [(L.ARG_SRC, self.src.memory), (L.ARG_DST, self.dst.memory)]
                  + self._stats({L.ARG_SCALE: w, L.ARG_SHIFT: b, L.ARG_MEAN: mean,
                                 L.ARG_VARIANCE: var}))
        self.dst.stage_out(y)

    def backward(self, x, w, mean, var, dy, dx, dw, db):
        L = self.L
        self.src.stage_in(x)
        self.diff_dst.stage_in(dy)
        self.diff_src.bind_out(dx)
        L.execute(self.bwd, [(L.ARG_SRC, self.src.memory),
                             (L.ARG_DIFF_DST, self.diff_dst.memory),
                             (L.ARG_DIFF_SRC, self.diff_src.memory)]
                  + self._stats({L.ARG_MEAN: mean, L.ARG_VARIANCE: var, L.ARG_SCALE: w,
                                 L.ARG_DIFF_SCALE: dw, L.ARG_DIFF_SHIFT: db}))
        self.diff_src.stage_out(dx)


def _rows(a):
    return a.reshape(a.shape[0] * a.shape[1], -1)


def _slabs(rows, width):
    step = max(1, SLAB // width)
    return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)], step


def numpy_forward(x, w, b, y):
    """y of batch norm for numpy float32 NCHW arrays; returns the batch's mean and biased
    variance (float64)."""
    n, c = x.shape[:2]
    xr, yr = _rows(x), _rows(y)
    slabs, step = _slabs(n * c, xr.shape[1])
    tmp = np.empty((step, xr.shape[1]), np.float32)
    row_mean, row_m2 = np.empty(n * c, np.float32), np.empty(n * c, np.float32)
    for lo, hi in slabs:
        t = tmp[:hi - lo]
        np.add.reduce(xr[lo:hi], axis=1, out=row_mean[lo:hi])
        row_mean[lo:hi] /= xr.shape[1]
        np.subtract(xr[lo:hi], row_mean[lo:hi, None], out=t)
        np.einsum("ij,ij->i", t, t, out=row_m2[lo:hi])
    rm = row_mean.reshape(n, c).astype(np.float64)
    mean = rm.mean(axis=0)
    var = (row_m2.reshape(n, c).sum(axis=0, dtype=np.float64)
           + xr.shape[1] * ((rm - mean) ** 2).sum(axis=0)) / (n * xr.shape[1])
    scale = w / np.sqrt(var + EPS)
    a, s = np.tile(scale.astype(np.float32), n), np.tile((b - mean * scale).astype(np.float32), n)
    for lo, hi in slabs:
        np.multiply(xr[lo:hi], a[lo:hi, None], out=yr[lo:hi])
        yr[lo:hi] += s[lo:hi, None]
    return mean, var


def numpy_backward(x, w, mean, var, dy, dx):
    """dx into `dx`; returns (dw, db) of `numpy_forward`."""
    n, c = x.shape[:2]
    xr, dyr, dxr = _rows(x), _rows(dy), _rows(dx)
    count = n * xr.shape[1]
    slabs, step = _slabs(n * c, xr.shape[1])
    tmp = np.empty((step, xr.shape[1]), np.float32)
    mr = np.tile(mean.astype(np.float32), n)
    sdy, sdyx = np.empty(n * c, np.float32), np.empty(n * c, np.float32)
    for lo, hi in slabs:
        t = tmp[:hi - lo]
        np.add.reduce(dyr[lo:hi], axis=1, out=sdy[lo:hi])
        np.subtract(xr[lo:hi], mr[lo:hi, None], out=t)
        np.einsum("ij,ij->i", dyr[lo:hi], t, out=sdyx[lo:hi])
    inv = 1.0 / np.sqrt(var + EPS)
    db = sdy.reshape(n, c).sum(axis=0, dtype=np.float64)
    dw = sdyx.reshape(n, c).sum(axis=0, dtype=np.float64) * inv
    k1 = w * inv  # dx = k1·dy + k2·x + k3 per channel
    k2 = -k1 * inv * dw / count
    k3 = -k1 * db / count - k2 * mean
    k1, k2, k3 = (np.tile(k.astype(np.float32), n) for k in (k1, k2, k3))
    for lo, hi in slabs:
        t = tmp[:hi - lo]
        np.multiply(dyr[lo:hi], k1[lo:hi, None], out=dxr[lo:hi])
        np.multiply(xr[lo:hi], k2[lo:hi, None], out=t)
        dxr[lo:hi] += t
        dxr[lo:hi] += k3[lo:hi, None]
    return dw, db


def kernels(shape):
    """{name: fn(x, w, b, dy, clock) -> ((y, dx, dw, db), forward s, backward s)}."""
    import paddle
    import paddle.nn.functional as F
    c = shape[1]

    def paddle_op(x, w, b, dy, clock):
        mean, var = paddle.zeros([c]), paddle.zeros([c])
        start = clock()
        y = F.batch_norm(x, mean, var, weight=w, bias=b, training=True, momentum=0.0,
                         epsilon=EPS)
        mid = clock()
        grads = paddle.grad([y], [x, w, b], [dy])
        return (y,) + tuple(grads), mid - start, clock() - mid

    def onednn(blocked):
        plan = OneDNNBatchNorm(shape, blocked)

        def run(x, w, b, dy, clock):
            start = clock()
            y, mean, var = paddle.empty(shape), paddle.empty([c]), paddle.empty([c])
            plan.forward(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(),
                         mean.data_ptr(), var.data_ptr())
            mid = clock()
            dx, dw, db = paddle.empty(shape), paddle.empty([c]), paddle.empty([c])
            plan.backward(x.data_ptr(), w.data_ptr(), mean.data_ptr(), var.data_ptr(),
                          dy.data_ptr(), dx.data_ptr(), dw.data_ptr(), db.data_ptr())
            return (y, dx, dw, db), mid - start, clock() - mid
        return run

    def numpy_kernel(x, w, b, dy, clock):
        view = lambda t: np.from_dlpack(t.detach())  # noqa: E731
        start = clock()
        y = paddle.empty(shape)
        mean, var = numpy_forward(view(x), view(w), view(b), view(y))
        mid = clock()
        dx = paddle.empty(shape)
        dw, db = numpy_backward(view(x), view(w), mean, var, view(dy), view(dx))
        end = clock()
        return (y, dx, paddle.to_tensor(dw), paddle.to_tensor(db)), mid - start, end - mid

    return {"paddle": paddle_op, "onednn_blocked": onednn(True), "onednn_plain": onednn(False),
            "numpy": numpy_kernel}


def compare(shape, repeats, clock):
    import paddle
    paddle.seed(0)
    x, dy = paddle.randn(shape) * 2 + 1, paddle.randn(shape)
    w, b = paddle.rand(shape[1:2]) + 0.5, paddle.randn(shape[1:2])
    for t in (x, w, b):
        t.stop_gradient = False
    fns = kernels(shape)
    want = [t.numpy() for t in fns["paddle"](x, w, b, dy, clock)[0]]
    out = {}
    for name, fn in fns.items():
        got = [t.numpy() for t in fn(x, w, b, dy, clock)[0]]  # also the warm-up
        out[name] = {"error": [float(f"{np.abs(g - r).max() / np.abs(r).max():.2g}")
                               for g, r in zip(got, want)], "times": []}
    for _ in range(repeats):
        for name, fn in fns.items():
            out[name]["times"].append(fn(x, w, b, dy, clock)[1:])
    for entry in out.values():
        fwd, bwd = np.median(np.array(entry.pop("times")), axis=0) * 1e3
        entry.update(forward_ms=round(float(fwd), 2), backward_ms=round(float(bwd), 2))
    return out


def backbone_steps(steps, batch=32):
    """Each step's seconds and its BatchNorm2D forwards' (IResNet18), wall and the calling
    thread's CPU time (all of the work with one thread), and the thread's minor page faults."""
    import paddle
    from plsc.models import build_model
    from plsc.models.batchnorm import BatchNorm2D
    paddle.seed(0)
    model = build_model("IResNet18", embedding_size=512)
    opt = paddle.optimizer.Momentum(0.1, momentum=0.9, parameters=model.parameters(),
                                    weight_decay=5e-4)
    x = paddle.to_tensor(np.random.RandomState(0).standard_normal(
        (batch, 3, 112, 112)).astype(np.float32))
    faults = lambda: resource.getrusage(resource.RUSAGE_THREAD).ru_minflt  # noqa: E731
    clocks = (time.perf_counter, time.thread_time, faults)
    spent, started = [0, 0, 0], {}

    def pre(layer, args):
        started[id(layer)] = [c() for c in clocks]

    def post(layer, args, out):
        for i, c in enumerate(clocks):
            spent[i] += c() - started[id(layer)][i]
    for layer in model.sublayers():
        if isinstance(layer, BatchNorm2D):
            layer.register_forward_pre_hook(pre)
            layer.register_forward_post_hook(post)
    rows = []
    for _ in range(steps):
        spent[:] = [0, 0, 0]
        start = [c() for c in clocks]
        model(x).square().mean().backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
        step = [c() - s for c, s in zip(clocks, start)]
        rows.append({"step_s": round(step[0], 3), "batchnorm_forward_s": round(spent[0], 3),
                     "step_thread_cpu_s": round(step[1], 3),
                     "batchnorm_forward_thread_cpu_s": round(spent[1], 3),
                     "step_page_faults": step[2], "batchnorm_forward_page_faults": spent[2]})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], help="default: cpu with 1 thread")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--shapes", nargs="*", type=int, default=None,
                    help="indices into IResNet's shapes (none: skip the kernels)")
    ap.add_argument("--steps", type=int, default=0, help="IResNet18 steps to time (0: none)")
    args = ap.parse_args()
    sys.path.insert(0, REPO)
    import plsc  # noqa: F401  -- first: sets MKL's dispatch before Paddle loads
    from plsc.process import cpu_setup, runtime
    runtime.select_device("cpu", cpu_threads=args.threads)
    clock_name = args.clock or ("cpu" if args.threads == 1 else "wall")
    clock = time.thread_time if clock_name == "cpu" else time.perf_counter
    picked = range(len(SHAPES)) if args.shapes is None else args.shapes
    report = {"benchmark": "batchnorm", "threads": cpu_setup.paddle_threads(),
              "clock": clock_name, "repeats": args.repeats, "load_avg_1m_start":
              os.getloadavg()[0], "kernels": {}}
    for i in picked:
        shape = list(SHAPES[i])
        report["kernels"][str(shape)] = compare(shape, args.repeats, clock)
        print(json.dumps({str(shape): report["kernels"][str(shape)]}), file=sys.stderr,
              flush=True)
    if args.steps:
        report["iresnet18_steps"] = backbone_steps(args.steps)
    report["load_avg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
