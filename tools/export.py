"""Export a trained backbone: Paddle inference model (paddle.jit.save) and ONNX (with paddle2onnx).

    python tools/export.py -c configs/arcface_r50.yaml -o Global.checkpoint=latest --output export/
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plsc.config import ConfigError, load_config  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description="Export a trained backbone for inference.")
    p.add_argument("-c", "--config", required=True, help="YAML config (Model, Data.image_size)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="e.g. -o Global.checkpoint=latest")
    p.add_argument("--output", help="folder to write (default: Global.output_dir/export)")
    p.add_argument("--no-onnx", action="store_true", help="skip the ONNX export")
    a = p.parse_args(argv)
    try:
        from plsc.engine.tasks import export
        for kind, path in export(load_config(a.config, a.override), a.output, not a.no_onnx).items():
            print(f"{kind}: {path}")
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
