"""Embeddings of a RecordIO set, a list file or an image folder, written as .npy (+ labels).

    python tools/extract.py -c CONFIG -o Global.checkpoint=latest --input data/ms1mv3 --output emb.npy
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plsc.config import ConfigError, load_config  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description="Extract embeddings to OUTPUT.npy and OUTPUT_labels.npy.")
    p.add_argument("-c", "--config", required=True, help="YAML config (Model, Data.image_size)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="e.g. -o Global.checkpoint=latest")
    p.add_argument("--input", required=True, help="folder with train.rec/train.idx, image folder, or list file")
    p.add_argument("--output", required=True, help="embeddings .npy (labels go to <stem>_labels.npy)")
    p.add_argument("--flip", action="store_true", help="add the embedding of the horizontal flip")
    p.add_argument("--batch-size", type=int, help="default: Eval.batch_size")
    a = p.parse_args(argv)
    try:
        from plsc.engine.tasks import extract
        emb, labels = extract(load_config(a.config, a.override), a.input, a.output, a.flip, a.batch_size)
        print(f"wrote {emb} and {labels}")
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
