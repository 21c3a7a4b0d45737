"""Throughput of tools/eval_ijb.py's pipeline, and where its time goes. Prints JSON.

    python benchmarks/benchmark_ijb.py --make-layout DIR [--num-images 3000] [--crop-size 250]
        (also writes the 1:N lists meta/ijbc_1N_{gallery_G1,gallery_G2,probe_mixed}.csv)
    python -m paddle.distributed.launch --nproc_per_node 2 benchmarks/benchmark_ijb.py -c configs/demo.yaml \
        --root DIR [-o Data.num_workers=1]

The second command, on every rank and in the same run: the whole task
(`plsc.apps.ijb.evaluate_ijb`: meta files, decode + align + backbone on this rank's
share, gather, scores, result files), then the Dataset alone over the rank's share
(read, decode, align: one process, no workers), then the backbone alone (normalise,
image + mirror) on pre-made batches of the same count. Without a checkpoint or
Global.pretrained the backbone is freshly initialised (seed Global.seed).
"""
import argparse
import json
import os
import sys
import time


def make_layout(out, num_images, crop_size, seed):
    from plsc.data.synthetic import generate_ijb, write_ijb_1n_lists
    per_identity = 3 * 4  # 3 templates of about 4 images
    t0 = time.perf_counter()
    ref = generate_ijb(out, "ijbc", num_identities=max(2, round(num_images / per_identity)),
                       templates_per_identity=3, face_size=112, crop_size=crop_size, max_pairs=100_000,
                       seed=seed)
    lists = write_ijb_1n_lists(out, "ijbc", ref)  # the 1:N galleries and probes (--protocol 1n)
    return {"root": out, "num_images": len(ref["names"]), "num_templates": len(set(ref["templates"].tolist())),
            "num_pairs": len(ref["labels"]),
            "1n_templates": {k: len(v[0]) for k, v in lists.items()}, "crop_size": crop_size, "seconds": time.perf_counter() - t0}


def benchmark(cfg, root, repeats):
    import numpy as np
    import paddle

    from plsc import distributed as pd
    from plsc.data import FaceTransform, IJBFaceDataset, read_ijb_meta
    from plsc.parts import build_backbone
    from plsc.process.runtime import start
    from plsc.checkpoint import find_checkpoint
    from plsc.apps.ijb import evaluate_ijb

    start(cfg)
    rank, world = pd.get_rank(), pd.get_world_size()
    g = cfg["Global"]
    if not g["pretrained"] and (not g["checkpoint"] or find_checkpoint(g["checkpoint"], g["output_dir"]) is None):
        paddle.seed(g["seed"])
        path = os.path.join(g["output_dir"], f"bench_backbone_rank{rank}.pdparams")
        os.makedirs(g["output_dir"], exist_ok=True)
        paddle.save(build_backbone(cfg).state_dict(), path)
        g["pretrained"] = path
    size = tuple(cfg["Data"]["image_size"])
    pd.barrier()
    t0 = time.perf_counter()
    result = evaluate_ijb(cfg, root, "IJBC", progress=False, out=open(os.devnull, "w"))
    pd.barrier()
    tool_s = time.perf_counter() - t0

    meta = read_ijb_meta(root, "IJBC")
    share = -(-meta.num_images // world)
    start, stop = min(rank * share, meta.num_images), min((rank + 1) * share, meta.num_images)
    ds = IJBFaceDataset(meta, size, start, stop)
    t0 = time.perf_counter()
    faces = [ds[i][0] for i in range(len(ds))]
    data_s = time.perf_counter() - t0

    from plsc.apps.tasks import trained_backbone
    model = trained_backbone(cfg)
    transform, bs = FaceTransform(size, train=False, output="uint8"), cfg["Eval"]["batch_size"]
    batches = [paddle.to_tensor(np.stack(faces[i:i + bs])) for i in range(0, len(faces), bs)]
    model_s = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        with paddle.no_grad():
            for images in batches:
                x = transform.normalize(images)
                (model(x) + model(paddle.flip(x, [3]))).numpy()
        model_s = min(model_s, time.perf_counter() - t0)
    mine = paddle.to_tensor(np.array([[tool_s, data_s, model_s, len(ds)]], np.float64))
    every = pd.gather_concat(mine).numpy()
    if rank == 0:
        n = result["num_images"]
        print(json.dumps({
            "world_size": world, "num_images": n, "num_templates": result["num_templates"],
            "num_pairs": result["num_pairs"], "model": cfg["Model"]["name"], "image_size": list(size),
            "batch_size": bs, "num_workers": cfg["Data"]["num_workers"],
            "tool_seconds": round(float(every[0, 0]), 3),
            "tool_images_per_s": round(n / float(every[0, 0]), 1),
            "per_rank": [{"rank": r, "images": int(v[3]), "decode_align_s": round(float(v[1]), 3),
                          "backbone_s": round(float(v[2]), 3),
                          "decode_align_share": round(float(v[1] / (v[1] + v[2])), 3)}
                         for r, v in enumerate(every)],
            "decode_align_images_per_s_per_rank": round(float(every[:, 3].sum() / every[:, 1].sum()), 1),
            "backbone_images_per_s_per_rank": round(float(every[:, 3].sum() / every[:, 2].sum()), 1),
            "decode_align_share": round(float(every[:, 1].sum() / (every[:, 1] + every[:, 2]).sum()), 3),
        }, indent=1))


def main(argv=None):
    parser = argparse.ArgumentParser(description="Benchmark the IJB evaluation (JSON on stdout).")
    parser.add_argument("-c", "--config", help="YAML config, e.g. configs/demo.yaml")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value (repeatable), e.g. -o Data.num_workers=1")
    parser.add_argument("--root", help="an IJBC-style folder (meta/, loose_crop/)")
    parser.add_argument("--make-layout", metavar="DIR", help="write a synthetic layout to DIR and exit")
    parser.add_argument("--num-images", type=int, default=3000)
    parser.add_argument("--crop-size", type=int, default=250)
    parser.add_argument("--repeats", type=int, default=2, help="backbone timing: best of this many")
    args = parser.parse_args(argv)
    if args.make_layout:
        print(json.dumps(make_layout(args.make_layout, args.num_images, args.crop_size, 0), indent=1))
        return 0
    if not (args.config and args.root):
        parser.error("-c CONFIG and --root are needed (or --make-layout DIR)")
    from plsc.config import load_config
    benchmark(load_config(args.config, args.override), args.root, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
