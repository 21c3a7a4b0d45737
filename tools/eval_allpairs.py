"""Exact TAR at FAR 1e-4 … 1e-7 over all pairs of a labelled embedding set (never the N x N matrix).

    python tools/extract.py -c CONFIG -o Global.checkpoint=latest --input data/test --output emb.npy
    python tools/eval_allpairs.py -c CONFIG --embeddings emb.npy
    python -m paddle.distributed.launch --nproc_per_node 8 tools/eval_allpairs.py -c CONFIG \
        --embeddings emb.npy --labels emb_labels.npy --far 1e-6 --far 1e-7
"""
from plsc.cli import FAR, config_parser, positive_int, run_tool
from plsc.process import ending


def evaluate(cfg, args):
    from plsc.apps.allpairs import evaluate_allpairs
    from plsc.metrics.allpairs import ALLPAIRS_FARS
    evaluate_allpairs(cfg, args.embeddings, args.labels, args.far or ALLPAIRS_FARS,
                      normalize=not args.no_normalize, block_mb=args.block_mb)


def main(argv=None):
    parser = config_parser("All-pairs verification: over the N(N-1)/2 unordered pairs of N labelled "
                           "embeddings (genuine: equal labels), the exact TAR at each FAR (threshold: "
                           "the lowest that accepts at most floor(FAR x impostors) impostors; a score "
                           "equal to it is not accepted). Writes allpairs_result.json to "
                           "Global.output_dir; launched ranks share the score blocks.")
    parser.add_argument("--embeddings", required=True, metavar="E.npy", help="[N, d] embeddings")
    parser.add_argument("--labels", metavar="L.npy",
                        help="[N] identity labels (default: <E stem>_labels.npy, as tools/extract.py "
                             "writes them)")
    parser.add_argument("--far", type=FAR, action="append",
                        help="a target FAR (repeatable; default 1e-4 1e-5 1e-6 1e-7)")
    parser.add_argument("--no-normalize", action="store_true",
                        help="score raw dot products (default: cosine of L2-normalised embeddings)")
    parser.add_argument("--block-mb", type=positive_int, default=64, help="score block budget in MB (default 64)")
    args = parser.parse_args(argv)
    return run_tool(args, evaluate, args)


if __name__ == "__main__":
    ending.end(main())
