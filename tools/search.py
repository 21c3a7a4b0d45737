"""Gallery search over embeddings: build an index, query it top-k, choose the open-set threshold,
report the overlap of a training and a test set.

    python tools/search.py -c CONFIG build --embeddings gallery.npy --index gallery.index [--kind hnsw]
    python tools/search.py -c CONFIG threshold --index gallery.index --nonmated heldout.npy --fpir 0.01
    python tools/search.py -c CONFIG query --index gallery.index --queries q.npy -k 10 --output top.npz \
        [--threshold 0.42 | --nonmated heldout.npy --fpir 0.01]
    python tools/search.py -c CONFIG overlap --train-names data/train_folder --test-names test_names.txt \
        --train-embeddings train.npy --test-embeddings test.npy --threshold 0.7 --output overlap.json
"""
from plsc.cli import FAR, config_parser, positive_int, run_tool
from plsc.process import ending


def task(cfg, args):
    from plsc.apps import search
    if args.command == "build":
        search.build(cfg, args.embeddings, args.index, args.ids, args.kind, not args.no_normalize,
                     args.nlist, args.nprobe, args.hnsw_m, args.ef_search)
    elif args.command == "threshold":
        search.threshold(cfg, args.index, args.nonmated, args.fpir)
    elif args.command == "query":
        search.query(cfg, args.index, args.queries, args.output, args.k, args.threshold, args.nonmated,
                     args.fpir)
    else:
        search.overlap(cfg, args.output, args.train_names, args.test_names, args.train_embeddings,
                       args.test_embeddings, args.threshold, args.train_labels, args.test_labels,
                       not args.no_normalize)


def main(argv=None):
    parser = config_parser("Search a gallery of embeddings (scores: cosine; accepted: score above the "
                           "threshold, equal is not accepted).")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write an index of gallery embeddings")
    b.add_argument("--embeddings", required=True, metavar="G.npy", help="[N, d] gallery embeddings")
    b.add_argument("--ids", metavar="IDS.npy",
                   help="[N] gallery ids (default: <G stem>_labels.npy when it exists, else row numbers)")
    b.add_argument("--index", required=True, metavar="FILE", help="the index file to write (.npz)")
    b.add_argument("--kind", choices=("exact", "ivf", "hnsw"), default="exact",
                   help="exact (blocked GEMM, default) or a faiss-cpu index (pip install faiss-cpu)")
    b.add_argument("--nlist", type=positive_int, help="ivf: inverted lists (default about 4 sqrt(N))")
    b.add_argument("--nprobe", type=positive_int, default=16, help="ivf: lists searched (default 16)")
    b.add_argument("--hnsw-m", type=positive_int, default=32, help="hnsw: links per node (default 32)")
    b.add_argument("--ef-search", type=positive_int, default=64, help="hnsw: candidates searched (default 64)")
    b.add_argument("--no-normalize", action="store_true", help="raw dot products instead of cosines")
    t = sub.add_parser("threshold", help="the open-set threshold at a target FPIR")
    t.add_argument("--index", required=True, metavar="FILE")
    t.add_argument("--nonmated", required=True, metavar="N.npy",
                   help="held-out queries of people not in the gallery")
    t.add_argument("--fpir", type=FAR, required=True, help="target false positive identification rate")
    q = sub.add_parser("query", help="each query's top-k to an .npz (scores, rows, ids, accepted)")
    q.add_argument("--index", required=True, metavar="FILE")
    q.add_argument("--queries", required=True, metavar="Q.npy")
    q.add_argument("-k", type=positive_int, default=10, help="results per query (default 10)")
    q.add_argument("--output", required=True, metavar="OUT.npz")
    q.add_argument("--threshold", type=float, help="mark queries whose top score is above it")
    q.add_argument("--nonmated", metavar="N.npy", help="choose the threshold from these at --fpir")
    q.add_argument("--fpir", type=FAR, default=0.01, help="with --nonmated (default 0.01)")
    o = sub.add_parser("overlap", help="identities a training set shares with a test set")
    o.add_argument("--train-names", metavar="DIR|FILE", help="identity folders, or one name a line")
    o.add_argument("--test-names", metavar="DIR|FILE")
    o.add_argument("--train-embeddings", metavar="T.npy")
    o.add_argument("--test-embeddings", metavar="E.npy")
    o.add_argument("--train-labels", metavar="L.npy", help="default: <T stem>_labels.npy when it exists")
    o.add_argument("--test-labels", metavar="L.npy", help="default: <E stem>_labels.npy when it exists")
    o.add_argument("--threshold", type=float, help="near-duplicate: a cosine above it")
    o.add_argument("--no-normalize", action="store_true")
    o.add_argument("--output", required=True, metavar="REPORT.json")
    args = parser.parse_args(argv)
    return run_tool(args, task, args)


if __name__ == "__main__":
    ending.end(main())
