"""Where a training rank's resident memory goes: the trainer of a benchmark_train case, built as
`tools/train.py` builds it, with its memory read at the boundaries of each step's phases.

    python -m paddle.distributed.launch --nproc_per_node 2 benchmarks/train_memory.py \\
        --case r18 --steps 6 --out mem            # writes mem.rank<r>.json

The config is benchmark_train.py's for the case (same images folder, batch, workers, 1 thread a
rank). At each probe: the process's VmRSS / VmHWM / RssAnon / RssFile / RssShmem (/proc), the
bytes Paddle's allocator hands out (`host_memory_stat` "Allocated", current and the peak since
the previous probe), glibc's heap (`mallinfo2`: in use, free but kept, mmapped), and the scratch
buffers of plsc's oneDNN plans. Probes: after the imports, after the Trainer is built, and in
every step after the batch arrives, after the backbone's forward, after the head's forward,
after the backward (before the optimizer), after the step and, in the first
`cpu_setup.SETTLING_STEPS` steps, after malloc's free pages are given back as the trainer
gives them back. Also each step's CPU time (user, system) and minor page faults.
"""
import argparse
import ctypes
import json
import os
import resource
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, os.environ.get("PLSC_REPO", REPO))  # the plsc to measure (another checkout)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    mb = 1 << 20
    return {"heap_in_use_mb": m.uordblks / mb, "heap_free_kept_mb": m.fordblks / mb,
            "heap_total_mb": m.arena / mb, "mmapped_mb": m.hblkhd / mb}


def _status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(line.split()[1]) / 1024
    return out


def _onednn_scratch_mb():
    """Bytes of the scratch buffers of plsc's oneDNN convolutions, and the plans made."""
    try:
        from plsc.kernels import onednn
        from plsc.kernels.onednn import conv, rows
    except ImportError:
        return {}
    held = 0
    for plan in conv._plans.values():  # buffers kept per plan (before the shared scratch)
        for value in vars(plan).values():
            args = list(value.values()) if isinstance(value, dict) else (
                [a for v in value if isinstance(v, dict) for a in v.values()]
                if isinstance(value, tuple) else [])
            held += sum(getattr(a, "buffer", None).nbytes for a in args
                        if getattr(a, "buffer", None) is not None)
    shared = onednn.scratch_bytes() if hasattr(onednn, "scratch_bytes") else 0
    return {"onednn_plans": len(conv._plans) + len(rows._plans),
            "onednn_scratch_mb": (held + shared) / (1 << 20)}


class Probe:
    def __init__(self):
        self.records = []
        from paddle.base import core
        self.core = core

    def __call__(self, name, step=None):
        core = self.core
        use = resource.getrusage(resource.RUSAGE_SELF)
        rec = {"probe": name, "step": step, "t": time.time(), "cpu_user_s": use.ru_utime,
               "cpu_sys_s": use.ru_stime, "minor_faults": use.ru_minflt}
        rec.update(_status())
        rec["paddle_allocated_mb"] = core.host_memory_stat_current_value("Allocated", 0) / (1 << 20)
        rec["paddle_peak_mb"] = core.host_memory_stat_peak_value("Allocated", 0) / (1 << 20)
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        rec.update(_mallinfo())
        rec.update(_onednn_scratch_mb())
        self.records.append(rec)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", default="r18")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--classes", type=int)
    p.add_argument("--per-identity", type=int, default=20)
    p.add_argument("--workdir", default=os.path.join(REPO, "output", "benchmark_train"))
    p.add_argument("--out", required=True, help="prefix: PREFIX.rank<r>.json")
    p.add_argument("--fine", action="store_true", help="also record the heap at every layer's "
                   "forward and its output's gradient")
    p.add_argument("--malloc-info", action="store_true",
                   help="write glibc's malloc_info (free chunks by size) to PREFIX.rank<r>.malloc.xml")
    p.add_argument("--no-settle", action="store_true", help="do not give malloc's free pages "
                   "back after the first steps (cpu_setup.release_freed_memory), as before")
    p.add_argument("-o", "--override", action="append", default=[],
                   help="config overrides, as tools/train.py's -o")
    args = p.parse_args(argv)
    status0 = _status()
    import benchmark_train as bt  # noqa: E402
    import paddle  # noqa: F401
    from plsc.config import apply_overrides, validate
    from plsc.process import cpu_setup
    from plsc.train import Trainer
    probe = Probe()
    probe.records.append(dict(probe="start", step=None, **status0))
    probe("imports")
    spec = bt.case_spec(args.case, args.classes)
    ns = argparse.Namespace(warmup=0, steps=args.steps, batch=args.batch, workers=args.workers)
    global_batch = args.batch * bt.RANKS
    identities = -(-max(args.steps, 25) * global_batch // args.per_identity) + 1
    images = os.path.join(args.workdir, f"images_{identities}x{args.per_identity}")
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    if rank == 0 or not os.path.isfile(os.path.join(images, "images.json")):
        bt.make_images(images, identities, args.per_identity)
    while not os.path.isfile(os.path.join(images, "images.json")):
        time.sleep(1)
    raw = bt.plsc_config(spec, ns, images)
    raw["Global"]["output_dir"] = os.path.join(args.workdir, "memory_run")
    raw["Checkpoint"] = {"interval": 10 ** 9}
    cfg = validate(apply_overrides(raw, args.override))
    trainer = Trainer(cfg)
    probe("trainer_built")

    state = {"step": 0}
    trainer.backbone.register_forward_post_hook(
        lambda layer, inputs, output: probe("backbone_forward", state["step"]))
    trainer.head.register_forward_post_hook(
        lambda layer, inputs, output: probe("head_forward", state["step"]))
    optimizer_step = trainer.optimizer_step

    def probed_optimizer_step(*a, **kw):
        probe("backward", state["step"])
        return optimizer_step(*a, **kw)
    trainer.optimizer_step = probed_optimizer_step
    fine = []  # --fine: the heap at every layer's forward and at its output's gradient
    if args.fine:
        def heap(tag):
            m = _mallinfo()
            fine.append((state["step"], tag, round(m["heap_total_mb"]), round(m["heap_in_use_mb"]),
                         round(probe.core.host_memory_stat_current_value("Allocated", 0) / 2**20)))

        def fwd_hook(name):
            def hook(layer, inputs, output):
                heap("F " + name)
                if not output.stop_gradient:
                    output.register_hook(lambda g: heap("B " + name))
            return hook
        for name, layer in trainer.backbone.named_sublayers():
            if not list(layer.children()):
                layer.register_forward_post_hook(fwd_hook(name))
    trainer.backbone.train()
    trainer.head.train()
    loader = trainer._loader()
    batches = iter(loader)
    for step in range(1, args.steps + 1):
        state["step"] = step
        micro = [next(batches)]
        probe("data", step)
        trainer.train_step(micro)
        probe("step_end", step)
        if step <= getattr(cpu_setup, "SETTLING_STEPS", 0) and not args.no_settle:  # as the Trainer
            cpu_setup.release_freed_memory()
            probe("released", step)
    batches.close()
    probe("loader_closed")
    if args.malloc_info:  # glibc's free chunks by size, per arena (XML)
        libc = ctypes.CDLL("libc.so.6")
        libc.fopen.restype = ctypes.c_void_p
        fp = libc.fopen(f"{args.out}.rank{rank}.malloc.xml".encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(fp))
        libc.fclose(ctypes.c_void_p(fp))
    trainer.close()
    out = {"rank": rank, "case": args.case, "overrides": args.override,
           "env": {k: os.environ[k] for k in os.environ if k.startswith(("PLSC_", "ONEDNN_",
                                                                         "DNNL_", "MALLOC_"))},
           "records": probe.records, "fine": fine}
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(out, f, indent=1)
    if rank == 0:
        keys = ("VmRSS", "VmHWM", "RssAnon", "RssShmem", "paddle_allocated_mb", "paddle_peak_mb",
                "heap_in_use_mb", "heap_free_kept_mb", "mmapped_mb", "onednn_scratch_mb")
        print("probe step " + " ".join(keys))
        for r in probe.records:
            print(f"{r['probe']:>16} {r['step'] if r['step'] is not None else '-':>3} "
                  + " ".join(f"{r.get(k, float('nan')):8.0f}" for k in keys))
        starts = [r["t"] for r in probe.records if r["probe"] == "data"]
        ends = [r["t"] for r in probe.records if r["probe"] == "step_end"]
        print("step s (data to step end): " + " ".join(f"{e - s:.2f}" for s, e in zip(starts, ends)))
        first = [r for r in probe.records if r["probe"] == "data"]
        last = [r for r in probe.records if r["probe"] == "step_end"]
        for key in ("cpu_user_s", "cpu_sys_s", "minor_faults"):
            print(f"{key} per step: " + " ".join(f"{b[key] - a[key]:.6g}" for a, b in zip(first, last)))


if __name__ == "__main__":
    main()
