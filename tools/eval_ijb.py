"""IJB-B / IJB-C template verification (1:1: TAR@FAR table and AUC) or identification (--protocol 1n:
CMC and TPIR at FPIR per gallery, and insightface's ijb_1n.py figures) of a trained backbone.

    python tools/eval_ijb.py -c configs/arcface_r50.yaml --root IJB_release/IJBC --target IJBC \
        -o Global.checkpoint=latest
    python -m paddle.distributed.launch --nproc_per_node 8 tools/eval_ijb.py -c CONFIG \
        --root IJB_release/IJBB --target IJBB -o Global.pretrained=backbone.pdparams
    python tools/eval_ijb.py -c configs/arcface_r50.yaml --root IJB_release/IJBC --target IJBC \
        --onnx buffalo_l/w600k_r50.onnx
    python tools/eval_ijb.py -c configs/arcface_r50.yaml --root IJB_release/IJBC --target IJBC \
        --protocol 1n --features ijbc_feats.npy
"""
from plsc.cli import add_onnx_options, config_parser, run_tool
from plsc.process import ending


def evaluate(cfg, args):
    if args.protocol == "1n":
        from plsc.apps.ijb_1n import evaluate_ijb_1n
        evaluate_ijb_1n(cfg, args.root, args.target, features=args.features,
                        save_features=args.save_features, detector_score=not args.no_detector_score,
                        normalize_images=args.normalize_images, onnx=args.onnx,
                        onnx_input=args.onnx_input)
        return
    from plsc.apps.ijb import evaluate_ijb
    evaluate_ijb(cfg, args.root, args.target, features=args.features, save_features=args.save_features,
                 detector_score=not args.no_detector_score, normalize_images=args.normalize_images,
                 onnx=args.onnx, onnx_input=args.onnx_input)


def main(argv=None):
    parser = config_parser("IJB-B/IJB-C template verification (insightface's protocol and layout "
                           "ROOT/meta, ROOT/loose_crop). Prints TAR at FAR 1e-6 .. 1e-1 and the AUC; "
                           "writes <target>_result.json, <target>_scores.npy and <target>_roc.png (target "
                           "in lower case: ijbc_result.json, ...) to Global.output_dir. With --protocol "
                           "1n: identification against the galleries of ROOT/meta/<target>_1N_*.csv, "
                           "<target>_1n_result.json. Weights: Global.checkpoint or Global.pretrained "
                           "(refused, exit 2, when they do not match the config's model), "
                           "or --onnx FILE.")
    parser.add_argument("--root", required=True, help="the target's folder, e.g. IJB_release/IJBC")
    parser.add_argument("--target", required=True, choices=("IJBC", "IJBB"), type=str.upper,
                        help="the protocol: reads ROOT/meta/<ijbc|ijbb>_*.txt")
    parser.add_argument("--protocol", choices=("1:1", "1n"), default="1:1",
                        help="1:1 template verification (default), or 1n identification: CMC at "
                             "rank 1/5/10/20 and TPIR at FPIR 0.001/0.01/0.1 per gallery (IJB-C "
                             "paper's open-set definitions) and their mean, and the figures of "
                             "insightface's ijb_1n.py (galleries merged)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--features", metavar="F.npy",
                        help="read the image features from F.npy instead of running the backbone")
    parser.add_argument("--save-features", metavar="F.npy",
                        help="write the [num_images, d] float32 image features (order of "
                             "<target>_name_5pts_score.txt)")
    parser.add_argument("--no-detector-score", action="store_true",
                        help="do not weight image features by their detector score")
    parser.add_argument("--normalize-images", action="store_true",
                        help="L2-normalise each image feature before pooling")
    add_onnx_options(parser, source)
    args = parser.parse_args(argv)
    return run_tool(args, evaluate, args)


if __name__ == "__main__":
    ending.end(main())
