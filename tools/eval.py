"""Verify a trained backbone on every Eval target of a config and print a table.

    python tools/eval.py -c configs/arcface_r50.yaml -o Global.checkpoint=latest
    python -m paddle.distributed.launch --nproc_per_node 8 tools/eval.py -c CONFIG -o Global.pretrained=backbone.pdparams
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plsc.config import ConfigError, load_config  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description="Verify a trained backbone (LFW protocol: 10-fold accuracy, "
                                            "TAR@FAR, ROC curve written to Global.output_dir/roc.png).")
    p.add_argument("-c", "--config", required=True, help="YAML config (Model, Data.image_size, Eval)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="e.g. -o Global.checkpoint=latest or -o Global.pretrained=backbone.pdparams")
    a = p.parse_args(argv)
    try:
        from plsc.engine.tasks import evaluate
        evaluate(load_config(a.config, a.override))
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
