"""Re-shard a checkpoint's classifier offline, or export/import it as one array.

    python tools/reshard.py CKPT --world-size 16 --output NEW_CKPT
    python tools/reshard.py CKPT --export classifier.npy [--array bias --export bias.npy]
    python tools/reshard.py CKPT --import classifier.npy [--import-bias bias.npy] --output NEW_CKPT
    python tools/reshard.py CKPT --dtype float32 --output NEW_CKPT

Training resumes on any number of ranks without this tool (it re-shards as it
loads); use it to prepare a checkpoint once, or to move the classifier in and out.
An --output inside a run's checkpoints/ folder locks that run's folder while it is written:
refused (exit status 73) while a training job uses it.

Head arrays keep their dtype (meta.json `head_dtypes`): re-sharding copies the stored
bits (8- and 4-bit arrays: each row's codes and scales). --export writes what plain numpy
reads: a bfloat16 array as float32 (exact), an 8- or 4-bit array as its float32 values, a
float16 or float32 array as stored; with K sub-centres the weight is [C, K, d]. --import
takes a float16/32/64 array and stores it in the checkpoint's dtype for that array (16 bits:
rounded to nearest even; 8 bits: quantised to nearest, a new scale a row); the replaced
array's optimizer state (4-bit too) restarts at zero. --dtype stores every head array (the
weight, the bias, their optimizer state, 4-bit state too) as float32, bfloat16 or float16,
e.g. an int8 run's checkpoint as float32 (a run of any dtype resumes from either: loads
convert too).
"""
import argparse
import sys

from plsc.checkpoint import (convert_checkpoint, export_classifier, import_classifier, read_meta,
                             reshard_checkpoint, verify_checkpoint)
from plsc.checkpoint.lock import lock_folder, run_folder_of
from plsc.cli import positive_int, report_mistake
from plsc.dtypes import FLOAT_DTYPES
from plsc.process import ending


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder (…/checkpoints/step_XXXXXXXX)")
    p.add_argument("--world-size", type=positive_int, help="re-shard the head for this many ranks")
    p.add_argument("--export", metavar="NPY", help="write head array --array of all classes "
                   "here (bfloat16, 8- and 4-bit arrays as float32, float16/float32 as stored)")
    p.add_argument("--array", default="weight",
                   help="head array to export: weight, bias, opt.weight.velocity, ... (default weight)")
    p.add_argument("--import", dest="import_", metavar="NPY",
                   help="classifier [C, d] ([C, K, d] with K sub-centres) to put in (any float "
                   "dtype; stored in the checkpoint's)")
    p.add_argument("--import-bias", metavar="NPY", help="bias [C] to put in (softmax heads)")
    p.add_argument("--dtype", choices=FLOAT_DTYPES,
                   help="store every head array (weight, bias, optimizer state) in this dtype")
    p.add_argument("--output", help="new checkpoint folder (for --world-size, --import, --dtype)")
    p.add_argument("--verify", choices=("full", "size", "none"), default="full",
                   help="check CKPT against its manifest first (default full: sizes and checksums)")
    a = p.parse_args(argv)
    lock = None
    try:
        meta = read_meta(a.checkpoint)
        verify_checkpoint(a.checkpoint, a.verify)
        if sum(x is not None for x in (a.world_size, a.export, a.import_, a.dtype)) != 1:
            p.error("give exactly one of --world-size, --export, --import, --dtype")
        if a.export:
            export_classifier(a.checkpoint, a.export, a.array)
            print(f"wrote {a.array} of {meta['num_classes']} classes to {a.export}")
            return 0
        if not a.output:
            p.error("--output is required with --world-size, --import and --dtype")
        run = run_folder_of(a.output)  # in a run's checkpoints/: one job at a time in that folder
        lock = lock_folder(run, "the run folder") if run else None
        for note in lock.notes if lock else ():
            print(f"plsc: {note}", file=sys.stderr)
        if a.world_size:
            reshard_checkpoint(a.checkpoint, a.output, a.world_size)
            print(f"wrote {a.output}: head split for {a.world_size} ranks "
                  f"(was {meta['world_size']})")
        elif a.dtype:
            convert_checkpoint(a.checkpoint, a.output, a.dtype)
            print(f"wrote {a.output}: head arrays stored as {a.dtype}")
        else:
            import_classifier(a.checkpoint, a.output, a.import_, a.import_bias)
            print(f"wrote {a.output} with the classifier from {a.import_}")
    except Exception as err:  # a damaged checkpoint 65, a folder in use 73, a bad argument 2, ...
        code = report_mistake(err, expected=(KeyError, ValueError))
        if code is None:
            raise
        return code
    finally:
        if lock is not None:
            lock.release()
    return 0


if __name__ == "__main__":
    ending.end(main())
