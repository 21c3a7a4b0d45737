"""Is the CPU fast path on? GFLOP/s of the head's three GEMMs and of one backbone training step,
beside the threads and the BLAS dispatch in use; one JSON line.

    python benchmarks/benchmark_cpu.py                       # plsc's set-up (import plsc first)
    PLSC_MKL_DISPATCH=keep python benchmarks/benchmark_cpu.py   # MKL's own choice, to compare
    PLSC_MALLOC=keep python benchmarks/benchmark_cpu.py         # malloc unmapping freed tensors
    python benchmarks/benchmark_cpu.py --threads 1 --backbone IResNet18 --batch 32

The head's GEMMs are those of one dense step of N x d features against C class centres:
logits = X W^T, dX = dlogits W, dW = dlogits^T X (2·N·d·C flops each), timed back to back.
The backbone step is forward, backward and an SGD-momentum update of a batch of random images;
its flops are counted from the convolutions and linear layers of the forward (2 per
multiply-add) times 3, the usual estimate for forward + backward.
"""
import argparse
import json
import os
import sys
import time

import plsc  # noqa: F401  -- before Paddle: sets MKL's dispatch on AMD processors
from plsc.process import runtime


def _best(fn, repeats):
    fn()  # warm-up (first touch, kernel selection)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def head_gemms(n, d, classes, repeats):
    import paddle
    x, w = paddle.randn([n, d]), paddle.randn([classes, d])
    dlogits = paddle.randn([n, classes])

    def run():
        paddle.matmul(x, w, transpose_y=True)
        paddle.matmul(dlogits, w)
        paddle.matmul(dlogits, x, transpose_x=True)
    seconds = _best(run, repeats)
    return {"shape": {"N": n, "d": d, "C": classes}, "seconds": seconds,
            "gflops": 3 * 2 * n * d * classes / seconds / 1e9}


def forward_flops(model, x):
    """2 x the multiply-adds of the model's Conv2D and Linear layers on input `x`."""
    import paddle
    total = [0]

    def conv(layer, inputs, output):
        k = layer.weight.shape  # [out, in/groups, kh, kw]
        total[0] += 2 * int(output.numel()) * int(k[1]) * int(k[2]) * int(k[3])

    def linear(layer, inputs, output):
        total[0] += 2 * int(output.numel()) * int(layer.weight.shape[0])
    hooks = [m.register_forward_post_hook(conv) for m in model.sublayers()
             if isinstance(m, paddle.nn.Conv2D)]
    hooks += [m.register_forward_post_hook(linear) for m in model.sublayers()
              if isinstance(m, paddle.nn.Linear)]
    with paddle.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return total[0]


def backbone_step(name, batch, size, repeats):
    import paddle
    from plsc.models import build_model
    paddle.seed(0)
    model = build_model(name, embedding_size=512, input_size=(size, size))
    model.train()
    opt = paddle.optimizer.Momentum(learning_rate=0.1, momentum=0.9, weight_decay=5e-4,
                                    parameters=model.parameters())
    x = paddle.randn([batch, 3, size, size])
    flops = 3 * forward_flops(model, x)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
    seconds = _best(step, repeats)
    return {"backbone": name, "batch": batch, "image_size": size, "seconds": seconds,
            "gflops": flops / seconds / 1e9}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: plsc's choice, see plsc.process.runtime)")
    parser.add_argument("--classes", type=int, default=100_000, help="head: class centres C")
    parser.add_argument("--batch-head", type=int, default=256, help="head: features N")
    parser.add_argument("--dim", type=int, default=512, help="head: embedding size d")
    parser.add_argument("--backbone", default="IResNet18", help="backbone of the step ('' skips it)")
    parser.add_argument("--batch", type=int, default=32, help="backbone: images per step")
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (the best is kept)")
    args = parser.parse_args(argv)
    import paddle
    paddle.set_device("cpu")
    threads_line = runtime.set_cpu_threads(args.threads)
    malloc_line = runtime.keep_freed_memory()
    result = {"cpu": runtime.cpu_description(), "usable_cores": runtime.usable_cores(),
              "threads": threads_line, "malloc": malloc_line,
              "MKL_DEBUG_CPU_TYPE": os.environ.get("MKL_DEBUG_CPU_TYPE"),
              "paddle": paddle.__version__,
              "head_gemms": head_gemms(args.batch_head, args.dim, args.classes, args.repeats)}
    if args.backbone:
        result["backbone_step"] = backbone_step(args.backbone, args.batch, args.image_size,
                                                args.repeats)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
