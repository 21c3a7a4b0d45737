"""What a checkpoint save adds to a process's peak RSS: the backbone's and AdamW's state written
by `CheckpointManager.save` (streamed, `plsc.checkpoint.paddle_file`) against the save it
replaced (`paddle.save` of each state into a `BytesIO`, then its bytes written), each in its
own process after one training step, the peak reset just before the save. One JSON line.

    python benchmarks/benchmark_save_memory.py                      # ViT-S at 112 x 112
    python benchmarks/benchmark_save_memory.py --backbone IResNet50
"""
import argparse
import io
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status(key):
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith(key)).split()[1])


def child(args):
    sys.path.insert(0, ROOT)
    from plsc.process import cpu_setup
    cpu_setup.apply(1)
    cpu_setup.keep_freed_memory()
    import paddle
    from plsc.checkpoint.manager import CheckpointManager
    from plsc.models import build_model
    model = build_model(args.backbone, embedding_size=512, input_size=tuple(args.image_size))
    opt = paddle.optimizer.AdamW(0.001, parameters=model.parameters())
    model(paddle.randn([2, 3, *args.image_size])).sum().backward()
    opt.step()
    opt.clear_grad(set_to_zero=False)
    cpu_setup.release_freed_memory()
    states = {"backbone": model.state_dict(), "trainer": {"backbone_opt": opt.state_dict()}}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    if args.mode == "stream":
        CheckpointManager(args.out, keep_last=1).save(1, {}, states["backbone"],
                                                       states["trainer"], {})
    else:
        for name, state in states.items():
            buf = io.BytesIO()
            paddle.save(state, buf)
            with open(os.path.join(args.out, name), "wb") as f:
                f.write(buf.getvalue())
            del buf
    tensors = [t for t in list(states["backbone"].values()) + list(opt.state_dict().values())
               if isinstance(t, paddle.Tensor)]
    print(json.dumps({"grown_bytes": _status("VmHWM") - before,
                      "state_bytes": sum(int(t.numel()) * t.element_size() for t in tensors),
                      "largest_tensor_bytes": max(int(t.numel()) * t.element_size()
                                                  for t in tensors)}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backbone", default="ViT_S")
    p.add_argument("--image-size", type=int, nargs=2, default=[112, 112])
    p.add_argument("--child", action="store_true")
    p.add_argument("--mode", choices=("stream", "bytesio"))
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from measure_backbone_memory import _machine
    line = {"backbone": args.backbone, "image_size": args.image_size, "machine": _machine()}
    for mode in ("stream", "bytesio"):
        with tempfile.TemporaryDirectory() as out:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--mode",
                                   mode, "--out", out, "--backbone", args.backbone,
                                   "--image-size", *map(str, args.image_size)],
                                  capture_output=True, text=True, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        line.update(state_bytes=r["state_bytes"], largest_tensor_bytes=r["largest_tensor_bytes"])
        line[f"{mode}_grown_bytes"] = r["grown_bytes"]
    print(json.dumps(line))


if __name__ == "__main__":
    sys.exit(main())
