"""Embeddings of a RecordIO set, a list file or an image folder, written as .npy (+ labels).

    python tools/extract.py -c CONFIG -o Global.checkpoint=latest --input data/ms1mv3 --output emb.npy
    python tools/extract.py -c CONFIG --onnx buffalo_l/w600k_r50.onnx --input data/ms1mv3 --output emb.npy
"""
from plsc.cli import add_onnx_options, config_parser, positive_int, run_tool
from plsc.process import ending


def extract(cfg, args):
    from plsc.apps.tasks import extract as extract_task
    emb, labels = extract_task(cfg, args.input, args.output, args.flip, args.batch_size, onnx=args.onnx,
                               onnx_input=args.onnx_input)
    print(f"wrote {emb} and {labels}")


def main(argv=None):
    parser = config_parser("Extract embeddings to OUTPUT.npy and OUTPUT_labels.npy.")
    parser.add_argument("--input", required=True,
                        help="folder with train.rec/train.idx, image folder, or list file")
    parser.add_argument("--output", required=True, help="embeddings .npy (labels: <stem>_labels.npy)")
    parser.add_argument("--flip", action="store_true", help="add the embedding of the horizontal flip")
    parser.add_argument("--batch-size", type=positive_int, help="default: Eval.batch_size")
    add_onnx_options(parser)
    args = parser.parse_args(argv)
    return run_tool(args, extract, args)


if __name__ == "__main__":
    ending.end(main())
