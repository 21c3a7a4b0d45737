"""Export a trained backbone: Paddle inference model (paddle.jit.save) and ONNX (with paddle2onnx).

    python tools/export.py -c configs/arcface_r50.yaml -o Global.checkpoint=latest --output export/

Prints the checkpoint (or weights file) exported, then one line per format: its path, or why it
was skipped (`onnx: skipped: --no-onnx`, or paddle2onnx not installed). A checkpoint trained
with another Model.name, Model.embedding_size or Data.image_size than the config's is refused
(exit 2, naming the -o that matches); see docs/weights.md, "Loading weights".
"""
from plsc.cli import config_parser, run_tool
from plsc.process import ending


def export(cfg, output, onnx):
    from plsc.apps.tasks import export as export_task
    paths = export_task(cfg, output, onnx)
    step = f" (step {paths['step']})" if paths["step"] is not None else ""
    print(f"exported {paths['source']}{step}")
    print(f"paddle: {paths['paddle']}")
    print(f"onnx: {paths['onnx']}" if paths["onnx"] else
          f"onnx: skipped: {'--no-onnx' if not onnx else paths['onnx_skipped']}")


def main(argv=None):
    parser = config_parser("Export a trained backbone for inference. Weights: Global.checkpoint "
                           "(a folder or 'latest', whose meta.json must match the config's "
                           "Model.name, Model.embedding_size and Data.image_size) or "
                           "Global.pretrained; every tensor must fit the model. Prints the "
                           "checkpoint exported and, per format, its path or why it was skipped.")
    parser.add_argument("--output", help="folder to write (default: Global.output_dir/export)")
    parser.add_argument("--no-onnx", action="store_true", help="skip the ONNX export")
    args = parser.parse_args(argv)
    return run_tool(args, export, args.output, not args.no_onnx)


if __name__ == "__main__":
    ending.end(main())
