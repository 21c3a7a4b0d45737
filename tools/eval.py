"""Verify a trained backbone on every Eval target of a config and print a table.

    python tools/eval.py -c configs/arcface_r50.yaml -o Global.checkpoint=latest
    python -m paddle.distributed.launch --nproc_per_node 8 tools/eval.py -c CONFIG -o Global.pretrained=backbone.pdparams
    python tools/eval.py -c configs/arcface_r50.yaml --onnx buffalo_l/w600k_r50.onnx
"""
from plsc.cli import add_onnx_options, config_parser, run_tool
from plsc.process import ending


def evaluate(cfg, args):
    from plsc.apps.tasks import evaluate as evaluate_task
    evaluate_task(cfg, onnx=args.onnx, onnx_input=args.onnx_input)


def main(argv=None):
    parser = config_parser("Verify a trained backbone (LFW protocol: 10-fold accuracy, TAR@FAR, ROC "
                           "curve written to Global.output_dir/roc.png). Weights: Global.checkpoint "
                           "(a folder or 'latest') or Global.pretrained (.pdparams, or an "
                           "arcface_torch .pt/.pth), or --onnx FILE. A checkpoint of another Model.name, "
                           "Model.embedding_size or Data.image_size, or weights that do not fit the "
                           "model, are refused (exit 2).")
    add_onnx_options(parser)
    args = parser.parse_args(argv)
    return run_tool(args, evaluate, args)


if __name__ == "__main__":
    ending.end(main())
