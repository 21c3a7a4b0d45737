"""The pieces every config-driven tool shares: `-c CONFIG -o Section.key=value`, turning a
bad config or a missing file into one line on stderr and exit code 2, bad data into one line
and exit code 65, an output folder in use or not writable into one line and 73 or 74, and a
SIGTERM or SIGINT before the work is done into one line and exit code 75 (`plsc.process.startup`)."""
import argparse
import atexit
import json
import os
import signal
import sys

from .process import startup
from .config import ConfigError, load_config
from .process.exits import CONFIG_ERROR_EXIT_CODE, DATA_ERROR_EXIT_CODE

__all__ = ["config_parser", "add_onnx_options", "run_tool", "report_summary",
           "DATA_ERROR_EXIT_CODE"]


def config_parser(description, override_example="-o Global.checkpoint=latest"):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("-c", "--config", required=True, help="YAML config, e.g. configs/demo.yaml")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=f"override a config value (repeatable), e.g. {override_example}")
    return parser


def add_onnx_options(parser, group=None):
    """`--onnx FILE` (into `group`, e.g. a mutually exclusive one, when given) and `--onnx-input`
    of the evaluation tools (plsc.apps.onnx_backbone); the choices are repeated here so that
    --help does not import Paddle."""
    (group or parser).add_argument(
        "--onnx", metavar="FILE",
        help="run this ONNX model (onnxruntime, CPU) instead of the config's backbone; Model and "
             "Global.checkpoint/pretrained are then not read, and the file's fixed input size "
             "replaces Data.image_size")
    parser.add_argument("--onnx-input", default="rgb", choices=("rgb", "bgr", "rgb255", "bgr255"),
                        help="what the ONNX file expects: rgb (default; RGB, (x - 127.5) / 127.5, as "
                             "insightface's model zoo, e.g. buffalo_l, and plsc's own export), bgr (the "
                             "same in BGR order), rgb255 / bgr255 (pixel values 0..255, e.g. "
                             "insightface's MXNet-converted files)")
    return parser


def run_tool(args, task, *extra, expected=(), before=None):
    """Load the config of `args`, call `task(cfg, *extra)`; returns the exit code (the task's
    own when it returns an int, e.g. a preempted training's). A DataError (a bad image or
    record, here or on another rank) prints one line and gives 65; a ConfigError, a
    FileNotFoundError or an exception of the types `expected` prints one line and gives 2. An
    output folder in use by another job (`FolderInUse`) or that cannot be written
    (`FolderNotWritable`) prints one line and gives 73 or 74. A SIGTERM or SIGINT ends the run
    with one line (`plsc: preempted before <before>; nothing to save ...`) and 75, until
    training's own handling takes over (`plsc.process.startup`)."""
    startup.hold()  # before Paddle is imported (tools/train.py holds from its first line)
    from .data.errors import DataError  # here: plsc.data imports Paddle, slow for --help
    from .checkpoint.lock import FolderInUse, FolderNotWritable
    from .distributed import launched_world_size
    startup.guard(before, wait_for_group=launched_world_size() > 1)
    try:
        code = task(load_config(args.config, args.override), *extra)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        code = DATA_ERROR_EXIT_CODE
    except (FolderInUse, FolderNotWritable) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        code = err.exit_code
    except (ConfigError, FileNotFoundError, *expected) as err:
        print(f"error: {err}", file=sys.stderr)
        code = CONFIG_ERROR_EXIT_CODE
    except BaseException:
        startup.end()  # a crash: its traceback and status, not a preemption
        raise
    code = code if type(code) is int else 0
    if code:
        startup.settle()
        _keep_status_on_sigterm(code)
    startup.end()
    return code


def report_summary(tool, make):
    """For a file-preparing tool without a config: call `make()`, print its summary (a dict) as
    one JSON line and give 0; a DataError (a bad input line or file) prints one line,
    `<tool>: error: ...`, and gives 65. A SIGTERM or SIGINT meanwhile ends it with one line
    and 75 (`plsc.process.startup`; the tool holds them from its first line): its workers end
    with it, and what it was writing stays a temporary file that the next run removes."""
    startup.hold()
    from .data.errors import DataError  # here: plsc.data imports Paddle, slow for --help
    startup.guard()
    try:
        summary = make()
    except DataError as err:
        print(f"{tool}: error: {err}", file=sys.stderr)
        return DATA_ERROR_EXIT_CODE
    finally:
        startup.end()
    print(json.dumps(summary))
    return 0


def _keep_status_on_sigterm(code):
    """While this process winds down with status `code`, a SIGTERM ends it with that status:
    Paddle's launcher terminates the other ranks when one exits, and its own exit status is the
    first rank's (a rank ended by the signal would hide why the job stopped). Once the
    interpreter shuts down, Python handlers no longer run and CPython puts the default action
    back, which would end the process as killed (seen in CI: the launcher's status was -15);
    from the atexit stage on SIGTERM is ignored instead (CPython leaves an ignored signal
    alone), so the process ends with `code` by itself (the launcher kills it after 3 s
    otherwise)."""
    def end(signum, frame):
        sys.stderr.flush()
        os._exit(code)
    try:
        signal.signal(signal.SIGTERM, end)
    except ValueError:  # not the main thread
        return
    atexit.register(signal.signal, signal.SIGTERM, signal.SIG_IGN)
