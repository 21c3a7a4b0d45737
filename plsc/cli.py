"""The pieces every config-driven tool shares: `-c CONFIG -o Section.key=value`, and
turning a bad config or a missing file into one line on stderr and exit code 2."""
import argparse
import sys

from .config import ConfigError, load_config

__all__ = ["config_parser", "run_tool"]


def config_parser(description, override_example="-o Global.checkpoint=latest"):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("-c", "--config", required=True, help="YAML config, e.g. configs/demo.yaml")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=f"override a config value (repeatable), e.g. {override_example}")
    return parser


def run_tool(args, task, *extra, expected=()):
    """Load the config of `args`, call `task(cfg, *extra)`; returns the exit code (the task's
    own when it returns an int, e.g. a preempted training's). A ConfigError, a
    FileNotFoundError or an exception of the types `expected` prints one line and gives 2."""
    try:
        code = task(load_config(args.config, args.override), *extra)
    except (ConfigError, FileNotFoundError, *expected) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return code if type(code) is int else 0
