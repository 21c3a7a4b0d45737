"""Export a trained backbone: Paddle inference model (paddle.jit.save) and ONNX (with paddle2onnx).

    python tools/export.py -c configs/arcface_r50.yaml -o Global.checkpoint=latest --output export/
"""
import sys

from plsc.cli import config_parser, run_tool


def export(cfg, output, onnx):
    from plsc.apps.tasks import export as export_task
    for kind, path in export_task(cfg, output, onnx).items():
        print(f"{kind}: {path}")


def main(argv=None):
    parser = config_parser("Export a trained backbone for inference.")
    parser.add_argument("--output", help="folder to write (default: Global.output_dir/export)")
    parser.add_argument("--no-onnx", action="store_true", help="skip the ONNX export")
    args = parser.parse_args(argv)
    return run_tool(args, export, args.output, not args.no_onnx)


if __name__ == "__main__":
    sys.exit(main())
