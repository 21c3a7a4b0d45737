"""Train a face-recognition model from a YAML config.

    python -m paddle.distributed.launch --nproc_per_node 8 tools/train.py -c configs/arcface_r50.yaml
    python tools/train.py -c configs/demo.yaml -o Global.max_steps=100     # one process
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plsc.config import ConfigError, load_config  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Train a backbone with a class-sharded margin-softmax head (PartialFC).")
    parser.add_argument("-c", "--config", required=True, help="YAML config, e.g. configs/demo.yaml")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value (repeatable), e.g. -o Optimizer.lr=0.05")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.override)
        from plsc.engine import Trainer
        Trainer(cfg).train()
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
