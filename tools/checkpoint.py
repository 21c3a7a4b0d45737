"""Check a checkpoint by hand, or make one from an arcface_torch training run.

    python tools/checkpoint.py verify output/demo/checkpoints/step_00000006 [--level size]
    python tools/checkpoint.py import-arcface-torch ARCFACE_OUTPUT -c CONFIG [-o KEY=VALUE ...]

verify: prints `OK <folder>` and exits 0 when every file matches the checkpoint's manifest
(sizes and CRC-32 checksums; `--level size`: sizes only), else prints the first damaged file and
exits 65. A checkpoint written before manifests existed gets the checks its files allow
(meta.json parses, every head .npy is as long as its header says).

import-arcface-torch: reads the checkpoint_gpu_<rank>.pt files of every rank of an arcface_torch
run (train_v2.py with save_all_states; any number of ranks; no torch needed) and writes a plsc
checkpoint under the config's Global.output_dir/checkpoints: the backbone, all class centres,
their and the backbone's SGD momentum, the step and epoch. The config must name the same
backbone (Model.name, e.g. r50) and Loss.num_classes; then `Global.checkpoint: auto` (or the
printed folder) resumes the run on any number of ranks. It locks Global.output_dir while it
writes: refused (exit status 73) while a training job uses that folder.
"""
import argparse
import sys

from plsc.checkpoint import read_meta, verify_checkpoint
from plsc.cli import report_mistake, run_tool
from plsc.process import ending


def verify(a):
    try:
        read_meta(a.checkpoint)
        verify_checkpoint(a.checkpoint, a.level)
    except Exception as err:  # a damaged file 65, a missing folder 2
        code = report_mistake(err)
        if code is None:
            raise
        return code
    print(f"OK {a.checkpoint}")
    return 0


def import_arcface_torch(cfg, folder):
    from plsc.process import runtime
    from plsc.parts import build_backbone
    from plsc.checkpoint.arcface_torch import arcface_torch_files, import_arcface_torch
    from plsc.checkpoint.lock import claim_folder
    runtime.select_device(cfg["Global"]["device"], cfg["Global"]["cpu_threads"])
    with claim_folder(cfg["Global"]["output_dir"]) as lock:  # it writes checkpoints/ and latest
        for note in lock.notes:
            print(f"plsc: {note}", file=sys.stderr)
        path = import_arcface_torch(arcface_torch_files(folder), cfg, build_backbone(cfg),
                                    log=lambda msg: print(msg, file=sys.stderr))
    print(f"wrote {path}; resume it with -o Global.checkpoint={path} (or Global.checkpoint: auto)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="check every file against the manifest")
    v.add_argument("checkpoint", help="a checkpoint folder (…/checkpoints/step_XXXXXXXX)")
    v.add_argument("--level", choices=("full", "size"), default="full",
                   help="full: sizes and checksums (default); size: sizes only")
    i = sub.add_parser("import-arcface-torch",
                       help="a plsc checkpoint from an arcface_torch run's checkpoint_gpu_<r>.pt")
    i.add_argument("folder", help="arcface_torch's output folder with checkpoint_gpu_<rank>.pt")
    i.add_argument("-c", "--config", required=True, help="the plsc config to go on with")
    i.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable)")
    a = p.parse_args(argv)
    if a.command == "verify":
        return verify(a)
    return run_tool(a, import_arcface_torch, a.folder, expected=(ValueError,))


if __name__ == "__main__":
    ending.end(main())
