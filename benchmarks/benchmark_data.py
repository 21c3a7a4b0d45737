"""Throughput of plsc's own DataLoader (the one the trainer uses) against the decode ceiling, in
one run. Prints JSON.

For each worker count W: the loader delivers batches of the trainer's dataset (a RecordIO set
read with output="uint8": read, JPEG decode, flip, HWC uint8) as Paddle tensors with W worker
processes; the ceiling is W forked processes doing the same reads, decodes and flips
(``ds[i]`` for the same batches, split the same way) with no transport at all. Both are timed
from the fork to the last image (the same start-up in both) over `--passes` passes of the
images, `--repeats` times interleaved
(ceiling, loader, ceiling, loader, ...); medians are reported. `bytes_copied_per_batch` counts
the copies of a batch's bytes between the decoded samples and the batch's tensor, from the
loader's code: 2 (samples into the shared-memory slot, slot into the tensor; 9 for the loader
before, which pickled batches through a pipe).

    python benchmarks/benchmark_data.py [--root DIR_WITH_TRAIN_REC] [--images 4096] [--workers 1 2 4]

Without --root a synthetic 112x112 JPEG rec is generated in a temporary folder.
"""
import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time

import plsc  # noqa: F401  -- before Paddle: MKL's dispatch on AMD processors
import plsc.data.loader
import numpy as np

from plsc.data import DataLoader, RecordIODataset
from plsc.data.synthetic import generate


def _decode_share(ds, batches, w, workers):
    for b, indices in enumerate(batches):
        if b % workers == w:
            for i in indices:
                ds[i]
    os._exit(0)


def ceiling(ds, batches, workers):
    """Images/s of `workers` forked processes decoding their share of `batches`, no transport."""
    ctx = multiprocessing.get_context("fork")
    start = time.perf_counter()
    procs = [ctx.Process(target=_decode_share, args=(ds, batches, w, workers)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return sum(map(len, batches)) / (time.perf_counter() - start)


def loader(ds, batches, workers):
    """Images/s of plsc.data.DataLoader with `workers` workers delivering `batches` as tensors."""
    start, count = time.perf_counter(), 0
    try:  # as the trainer: tensors reused in turn (the loader before had no such option)
        batches_of = DataLoader(ds, batches, num_workers=workers, reuse=4)
    except TypeError:
        batches_of = DataLoader(ds, batches, num_workers=workers)
    for x, _ in batches_of:
        count += x.shape[0]
    return count / (time.perf_counter() - start)


def run(root, limit, worker_counts, batch_size, repeats, passes=1):
    ds = RecordIODataset(root, train=True)
    ds.transform.output = "uint8"  # as the trainer reads
    n = min(limit, len(ds)) if limit else len(ds)
    order = np.random.default_rng(0).permutation(n).tolist()
    batches = [order[i:i + batch_size] for i in range(0, n - batch_size + 1, batch_size)] * passes
    sample = ds[0][0]
    # Copies of a batch's bytes between the samples and its tensor, counted in the loader's code:
    # slots: into the slot, into the tensor. Pipe (before): np.stack, pickle.dumps, header +
    # payload, os.write, os.read, bytearray +=, slice for pickle.loads, unpickling, to_tensor.
    shared = hasattr(plsc.data.loader, "Slots")
    copies = 2 if shared else 9
    result = {"images": len(batches) * batch_size, "batch_size": batch_size,
              "image_shape": list(sample.shape), "image_dtype": str(sample.dtype),
              "bytes_per_batch": int(sample.nbytes * batch_size + 8 * batch_size),
              "transport": "shared-memory slots" if shared else "pickled through a pipe",
              "bytes_copied_per_batch": int(copies * (sample.nbytes + 8) * batch_size),
              "cpu_count": os.cpu_count(), "load_average_before": os.getloadavg()[0],
              "repeats": repeats, "goal_ratio_at_2_workers": 0.9}
    loader(ds, batches[:2], 1)  # warm: page cache, imports
    for w in worker_counts:
        ceil, load = [], []
        for _ in range(repeats):
            ceil.append(ceiling(ds, batches, w))
            load.append(loader(ds, batches, w))
        c, m = statistics.median(ceil), statistics.median(load)
        result[f"workers{w}"] = {"ceiling_images_per_s": round(c, 1), "loader_images_per_s": round(m, 1),
                                 "ratio": round(m / c, 3),
                                 "ratios_per_repeat": [round(b / a, 3) for a, b in zip(ceil, load)]}
    result["load_average_after"] = os.getloadavg()[0]
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", help="folder with train.rec/train.idx (default: generate a synthetic one)")
    parser.add_argument("--images", type=int, default=4096, help="images to time (and to generate)")
    parser.add_argument("--image-size", type=int, default=112, help="size of generated images")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4],
                        help="worker counts to time (default: 1 2 4)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--passes", type=int, default=3,
                        help="times each timing goes over the images (start-up weighs less)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed passes; medians reported")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root
        if root is None:
            root = tmp
            per_id = 16
            generate(root, image_size=args.image_size, num_identities=max(1, args.images // per_id),
                     images_per_identity=per_id, num_val_identities=2, num_pairs=2, quality=95)
        result = run(root, args.images, args.workers, args.batch_size, args.repeats, args.passes)
    result["source"] = args.root or f"synthetic {args.image_size}x{args.image_size} JPEG q95"
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
