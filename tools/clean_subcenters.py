"""Clean a noisy training set with a sub-centre (K > 1) checkpoint (Sub-center ArcFace, ECCV 2020).

    python tools/clean_subcenters.py -c CONFIG [--checkpoint latest|PATH] [--threshold 75] [--out DIR]
    python -m paddle.distributed.launch --nproc_per_node 2 tools/clean_subcenters.py -c CONFIG ...

Embeds the config's training set (Data section, no augmentation) with the checkpoint's
backbone, finds each class's dominant centre (the one most of its samples pick) and keeps
the samples within --threshold degrees of it. Writes to --out (default
<Global.output_dir>/cleaned): train_clean.lst, dropped.lst, summary.json, angles.png, for a
RecordIO source rec/ (the kept records), and checkpoint_k1/ (one centre per class: the
dominant ones) to go on training with the cleaned set:

    python tools/train.py -c CONFIG -o Global.checkpoint=OUT/checkpoint_k1 -o Loss.sub_centers=1 \
        -o Data.dataset=list -o Data.root=OUT/train_clean.lst -o Global.max_steps=MORE

See plsc/apps/cleaning.py for the details.
"""
from plsc.cli import config_parser, run_tool
from plsc.process import ending


def clean(cfg, checkpoint, threshold, out_dir, write_rec):
    from plsc.apps.cleaning import clean_subcenters
    summary = clean_subcenters(cfg, checkpoint, threshold, out_dir, write_rec=write_rec)
    if summary is None:  # not rank 0
        return 0
    d = summary["dominance"]
    print(f"checkpoint {summary['checkpoint']} (K={summary['sub_centers']}), threshold "
          f"{summary['threshold_degrees']:g} degrees")
    print(f"samples: kept {summary['samples_kept']}, dropped {summary['samples_dropped']} of "
          f"{summary['samples']} ({100 * summary['kept_fraction']:.2f} % kept)")
    print(f"classes: kept {summary['classes_kept']}, dropped {summary['classes_dropped']} of "
          f"{summary['classes_with_samples']} with samples ({summary['classes']} in the head)")
    print(f"samples picking their class's dominant centre: {d['samples_picking_dominant']}, "
          f"another centre: {d['samples_picking_other']}")
    for name, path in summary["outputs"].items():
        print(f"{name}: {path}")
    return 0


def main(argv=None):
    parser = config_parser("Drop the samples far from their class's dominant sub-centre and "
                           "write a cleaned list and a K=1 checkpoint.",
                           override_example="-o Data.num_workers=4")
    parser.add_argument("--checkpoint", default=None,
                        help="a checkpoint folder or 'latest' (default: Global.checkpoint, else latest)")
    parser.add_argument("--threshold", type=float, default=75.0,
                        help="keep samples at most this angle (degrees, in (0, 180)) from their "
                             "class's dominant centre (default 75)")
    parser.add_argument("--out", default=None, help="output folder (default <Global.output_dir>/cleaned)")
    parser.add_argument("--no-rec", action="store_true",
                        help="RecordIO source: write the kept keys only, not a cleaned rec")
    args = parser.parse_args(argv)
    return run_tool(args, clean, args.checkpoint, args.threshold, args.out, not args.no_rec)


if __name__ == "__main__":
    ending.end(main())
