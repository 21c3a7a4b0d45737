"""The MegaFace protocol: rank-1 identification per distractor count, the CMC, and TAR at FAR 1e-6,
for a probe set (FaceScrub layout) against a distractor set, from images or embeddings.

    python tools/eval_megaface.py -c CONFIG -o Global.checkpoint=latest --probes facescrub/ \
        --distractors megaface_list.txt --probe-noise facescrub_noises.txt \
        --distractor-noise megaface_noises.txt --save-embeddings emb/mf
    python tools/eval_megaface.py -c CONFIG --probes emb/mf_probes.npy --distractors emb/mf_distractors.npy
"""
from plsc.cli import FAR, add_onnx_options, config_parser, positive_int, run_tool
from plsc.process import ending


def evaluate(cfg, args):
    from plsc.apps.megaface import evaluate_megaface
    from plsc.metrics.megaface import MEGAFACE_COUNTS
    evaluate_megaface(cfg, args.probes, args.distractors, args.probe_noise, args.distractor_noise,
                      args.count or MEGAFACE_COUNTS, args.far or (1e-6,), args.save_embeddings,
                      onnx=args.onnx, onnx_input=args.onnx_input)


def main(argv=None):
    parser = config_parser("MegaFace protocol: every ordered pair of two images of one probe identity "
                           "is a search among the distractors (rank 1: the mate scores above every "
                           "distractor; a tie is a miss), at distractor counts 10, 100, ... and all; the "
                           "CMC over all distractors; TAR at FAR over probe-probe genuine and probe-"
                           "distractor impostor pairs. Writes megaface_result.json, megaface_cmc.png, "
                           "megaface_rank1.png and megaface_roc.png to Global.output_dir.")
    parser.add_argument("--probes", required=True, metavar="DIR|LIST|P.npy",
                        help="identity folders (FaceScrub layout), a 'path label' list, or embeddings "
                             "(labels <stem>_labels.npy; paths <stem>_paths.txt for a noise list)")
    parser.add_argument("--distractors", required=True, metavar="LIST|D.npy",
                        help="image paths, one a line (relative to the list's folder), or embeddings "
                             "(paths <stem>_paths.txt for a noise list)")
    parser.add_argument("--probe-noise", metavar="FILE", help="probe images to drop, one path a line")
    parser.add_argument("--distractor-noise", metavar="FILE", help="distractors to drop, one path a line")
    parser.add_argument("--count", type=positive_int, action="append",
                        help="a distractor count (repeatable; default 10 100 ... 1000000; all are "
                             "always added)")
    parser.add_argument("--far", type=FAR, action="append", help="a target FAR (default 1e-6)")
    parser.add_argument("--save-embeddings", metavar="STEM",
                        help="write STEM_probes.npy (+ _labels.npy, _paths.txt) and "
                             "STEM_distractors.npy (+ _paths.txt), noise dropped")
    add_onnx_options(parser)
    args = parser.parse_args(argv)
    return run_tool(args, evaluate, args)


if __name__ == "__main__":
    ending.end(main())
