r"""What a training configuration needs before it runs: memory per rank, the bytes of each
collective and the FLOPs of a step, the largest class count that fits, images/s and the time of
an epoch (calibrated against published throughputs, the error stated) and the bound of a step.

    python tools/plan.py -c configs/demo.yaml                  # this machine's CPU, 2 ranks
    python tools/plan.py -c configs/glint360k_r100_pfc.yaml --device v100-32gb --ranks 8
    python tools/plan.py -c configs/wf42m_vit_t_pfc03.yaml --device a100-80gb --ranks 64 \
        -o Loss.num_classes=100000000 -o Loss.param_dtype=int8

A configuration that does not fit prints one line on stderr, nothing on stdout (with --json: the
plan's figures, "fits": false and the line), and exits with status 78: what does not fit and by
how much; each change that would make it fit, planned again (Partial FC, int8 centres,
Model.recompute=true, the largest Data.batch_size that fits, a number of ranks); and when no
number of ranks would, why more ranks cannot help (on the cpu profile the ranks share this
machine's memory; on a GPU the terms that do not shrink with more ranks, such as the backbone's
activations, exceed the device; or the classes cannot be split over more ranks). A bad input
(a config key, a backbone without measured activations, --peer on the cpu profile) is one error
line and status 2. docs/scaling.md explains the model and its checks.
"""
import argparse
import sys

from plsc.process import ending, startup

startup.hold()

from plsc.cli import positive_int, run_tool  # noqa: E402

EXAMPLES, STATUS = __doc__.split("\n\n")[1:3]


def parser():
    p = argparse.ArgumentParser(
        description="Plan a training run: memory per rank, collectives, FLOPs, capacity.",
        epilog="examples:\n" + EXAMPLES + "\n\n" + STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", required=True, help="YAML config, e.g. configs/demo.yaml")
    p.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable), e.g. -o Loss.num_classes=2000000")
    p.add_argument("--ranks", type=positive_int, default=None,
                   help="ranks of the run (default: 2 on cpu, 8 on a GPU profile)")
    p.add_argument("--device", default="cpu",
                   choices=("cpu", "v100-32gb", "a100-80gb", "h100-80gb"),
                   help="device profile (default cpu: this machine, peak RSS)")
    p.add_argument("--peer", default=None, choices=("arcface_torch_v1", "arcface_torch_v2"),
                   help="plan a peer's head (counted from its code) in place of plsc's, to set "
                        "beside the peer's published memory (GPU profiles; docs/scaling.md)")
    p.add_argument("--images", type=positive_int, default=None,
                   help="images in the training set, for the time of an epoch (default: the "
                        "published size of the data set with Loss.num_classes classes)")
    p.add_argument("--json", action="store_true",
                   help="print every figure of the plan as one JSON object instead of text")
    return p


def run(cfg, args):
    import json
    from plsc.config import ConfigError
    from plsc.process.exits import DOES_NOT_FIT_EXIT_CODE
    from plsc.train.plan import fits, plan
    from plsc.train.plan.report import does_not_fit, figures, render
    ranks = args.ranks if args.ranks is not None else (2 if args.device == "cpu" else 8)
    try:
        p = plan(cfg, ranks, args.device, peer=args.peer)
    except (KeyError, ValueError) as err:  # no measured activations, a bad --ranks
        raise ConfigError(str(err).strip("'\"")) from None
    fig = figures(p, args.images)
    if not fits(p):
        line = does_not_fit(p)
        if args.json:
            print(json.dumps(dict(fig, does_not_fit=line)))
        print(f"error: {line}", file=sys.stderr, flush=True)
        return DOES_NOT_FIT_EXIT_CODE
    print(json.dumps(fig) if args.json else render(fig))
    return 0


def main(argv=None):
    args = parser().parse_args(argv)
    return run_tool(args, run, args)


if __name__ == "__main__":
    ending.end(main())
