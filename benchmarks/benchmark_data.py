"""Throughput of the RecordIO dataset (read + decode + transforms) against a plain
`cv2.imdecode` loop over the same encoded bytes, in the same run. Prints JSON.

Two outputs are measured: `float32` (ds[i] is the normalised CHW float32 array)
and `uint8` (ds[i] is the decoded, flipped, resized HWC uint8 image; the trainer
normalises whole batches on the device with FaceTransform.normalize, timed
here too on the CPU, per image).

    python benchmarks/benchmark_data.py [--root DIR_WITH_TRAIN_REC] [--images 3000] [--workers 2]

Without --root a synthetic 112x112 JPEG rec is generated in a temporary folder.
"""
import argparse
import json
import tempfile
import time

import plsc  # noqa: F401  -- before Paddle: MKL's dispatch on AMD processors
import cv2
import numpy as np
import paddle

from plsc.data import RecordIODataset, irheader
from plsc.data.synthetic import generate


def _rate(fn, n, repeats):
    """Best images/s of `repeats` runs of fn() handling n images."""
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = max(best, n / (time.perf_counter() - start))
    return best


def run(root, limit, workers, batch_size, repeats):
    ds = RecordIODataset(root, train=True)
    n = min(limit, len(ds)) if limit else len(ds)
    blobs = [bytes(irheader.unpack(ds.reader.read(int(k)))[1]) for k in ds.keys[:n]]

    def plain_decode():
        for b in blobs:
            cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR)

    def dataset_loop():
        for i in range(n):
            ds[i]

    raw = RecordIODataset(root, train=True)
    raw.transform.output = "uint8"

    def raw_loop():
        for i in range(n):
            raw[i]

    batch = paddle.to_tensor(np.stack([raw[i][0] for i in range(min(n, batch_size))]))

    def normalize_batches():
        for _ in range(0, n, len(batch)):
            raw.transform.normalize(batch)

    plain, through, through_raw = 0.0, 0.0, 0.0
    for _ in range(repeats):  # interleaved, so all see the same machine state
        plain = max(plain, _rate(plain_decode, n, 1))
        through = max(through, _rate(dataset_loop, n, 1))
        through_raw = max(through_raw, _rate(raw_loop, n, 1))
    normalize_rate = _rate(normalize_batches, len(range(0, n, len(batch))) * len(batch), repeats)

    def loader_pass(num_workers, dataset=ds):
        subset = paddle.io.Subset(dataset, list(range(n)))
        loader = paddle.io.DataLoader(subset, batch_size=batch_size, shuffle=True, num_workers=num_workers,
                                      drop_last=True, use_shared_memory=num_workers > 0)
        it = iter(loader)
        next(it)  # worker start-up is not throughput
        start, count = time.perf_counter(), 0
        for x, _ in it:
            count += x.shape[0]
        return count / (time.perf_counter() - start)

    return {
        "images": n,
        "image_shape": list(ds[0][0].shape),
        "mean_encoded_bytes": round(float(np.mean([len(b) for b in blobs])), 1),
        "cv2_threads": cv2.getNumThreads(),
        "imdecode_images_per_s": round(plain, 1),
        "dataset_images_per_s": round(through, 1),
        "ratio_single_process": round(through / plain, 3),
        "dataset_uint8_images_per_s": round(through_raw, 1),
        "ratio_single_process_uint8": round(through_raw / plain, 3),
        "batch_normalize_cpu_images_per_s": round(normalize_rate, 1),
        "target_ratio": 0.85,
        "dataloader_workers0_images_per_s": round(loader_pass(0), 1),
        f"dataloader_workers{workers}_images_per_s": round(loader_pass(workers), 1),
        "dataloader_uint8_workers0_images_per_s": round(loader_pass(0, raw), 1),
        f"dataloader_uint8_workers{workers}_images_per_s": round(loader_pass(workers, raw), 1),
        "batch_size": batch_size,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", help="folder with train.rec/train.idx (default: generate a synthetic one)")
    parser.add_argument("--images", type=int, default=3000, help="images to time (and to generate)")
    parser.add_argument("--image-size", type=int, default=112, help="size of generated images")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers for the multi-process figure")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes; the best is reported")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root
        if root is None:
            root = tmp
            per_id = 10
            generate(root, image_size=args.image_size, num_identities=max(1, args.images // per_id),
                     images_per_identity=per_id, num_val_identities=2, num_pairs=2, quality=95)
        result = run(root, args.images, args.workers, args.batch_size, args.repeats)
    result["source"] = args.root or f"synthetic {args.image_size}x{args.image_size} JPEG q95"
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
