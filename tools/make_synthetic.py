"""Generate a synthetic-identity training rec and a held-out verification pack.

    python tools/make_synthetic.py --output data/synthetic [--image-size 56] [--identities 1000]
        [--images-per-identity 16] [--val-identities 200] [--pairs 1000] [--seed 0]

Prints a summary as one JSON line. A bad number ends with argparse's line and exit status 2,
an output folder that cannot be written with one line and 74 (docs/faults.md).
"""
import argparse
import time

from plsc.cli import in_range, positive_float, positive_int, report_summary
from plsc.process import ending


def make(args):
    from plsc.data.synthetic import generate  # here: plsc.data imports Paddle, slow for --help
    start = time.perf_counter()
    info = generate(args.output, image_size=args.image_size, num_identities=args.identities,
                    images_per_identity=args.images_per_identity, num_val_identities=args.val_identities,
                    num_pairs=args.pairs, seed=args.seed, strength=args.strength)
    info["seconds"] = round(time.perf_counter() - start, 1)
    return info


def main(argv=None):
    at_least_2 = in_range(int, 2, what="an integer of at least 2")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="folder for train.rec, train.idx, property and val.bin")
    parser.add_argument("--image-size", type=positive_int, default=56)
    parser.add_argument("--identities", type=positive_int, default=1000, help="training identities")
    parser.add_argument("--images-per-identity", type=positive_int, default=16)
    parser.add_argument("--val-identities", type=at_least_2, default=200,
                        help="held-out identities for the pairs (at least 2)")
    parser.add_argument("--pairs", type=at_least_2, default=1000,
                        help="verification pairs (half same, half different; at least 2)")
    parser.add_argument("--strength", type=positive_float, default=1.2,
                        help="scale of the within-identity variation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return report_summary(lambda: make(args))


if __name__ == "__main__":
    ending.end(main())
