"""Generate a synthetic-identity training rec and a held-out verification pack.

    python tools/make_synthetic.py --output data/synthetic [--image-size 56] [--identities 1000]
        [--images-per-identity 16] [--val-identities 200] [--pairs 1000] [--seed 0]
"""
import argparse
import json
import time

from plsc.data.synthetic import generate


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="folder for train.rec, train.idx, property and val.bin")
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--identities", type=int, default=1000, help="training identities")
    parser.add_argument("--images-per-identity", type=int, default=16)
    parser.add_argument("--val-identities", type=int, default=200, help="held-out identities for the pairs")
    parser.add_argument("--pairs", type=int, default=1000, help="verification pairs (half same, half different)")
    parser.add_argument("--strength", type=float, default=1.2, help="scale of the within-identity variation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    info = generate(args.output, image_size=args.image_size, num_identities=args.identities,
                    images_per_identity=args.images_per_identity, num_val_identities=args.val_identities,
                    num_pairs=args.pairs, seed=args.seed, strength=args.strength)
    info["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
