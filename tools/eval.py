"""Verify a trained backbone on every Eval target of a config and print a table.

    python tools/eval.py -c configs/arcface_r50.yaml -o Global.checkpoint=latest
    python -m paddle.distributed.launch --nproc_per_node 8 tools/eval.py -c CONFIG -o Global.pretrained=backbone.pdparams
"""
import sys

from plsc.cli import config_parser, run_tool


def evaluate(cfg):
    from plsc.apps.tasks import evaluate as evaluate_task
    evaluate_task(cfg)


def main(argv=None):
    parser = config_parser("Verify a trained backbone (LFW protocol: 10-fold accuracy, TAR@FAR, ROC "
                           "curve written to Global.output_dir/roc.png). Weights: Global.checkpoint "
                           "(a folder or 'latest') or Global.pretrained (.pdparams).")
    return run_tool(parser.parse_args(argv), evaluate)


if __name__ == "__main__":
    sys.exit(main())
