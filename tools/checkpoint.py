"""Check a checkpoint by hand.

    python tools/checkpoint.py verify output/demo/checkpoints/step_00000006 [--level size]

Prints `OK <folder>` and exits 0 when every file matches the checkpoint's manifest (sizes and
CRC-32 checksums; `--level size`: sizes only), else prints the first damaged file and exits 65.
A checkpoint written before manifests existed gets the checks its files allow (meta.json
parses, every head .npy is as long as its header says).
"""
import argparse
import sys

from plsc.cli import DATA_ERROR_EXIT_CODE
from plsc.checkpoint import CheckpointDamaged, read_meta, verify_checkpoint


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="check every file against the manifest")
    v.add_argument("checkpoint", help="a checkpoint folder (…/checkpoints/step_XXXXXXXX)")
    v.add_argument("--level", choices=("full", "size"), default="full",
                   help="full: sizes and checksums (default); size: sizes only")
    a = p.parse_args(argv)
    try:
        read_meta(a.checkpoint)
        verify_checkpoint(a.checkpoint, a.level)
    except CheckpointDamaged as err:
        print(f"error: {err}", file=sys.stderr)
        return DATA_ERROR_EXIT_CODE
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"OK {a.checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
