"""The pieces every tool shares: `-c CONFIG -o Section.key=value`, the argument types of
numbers (`positive_int`, `positive_float`, `in_range`: a bad value is argparse's one line and
exit code 2), and turning a mistake into one line `error: ...` on stderr and its exit code
(`mistake`): a bad config or a missing file 2, bad data 65, an output folder in use 73, a
file or folder that cannot be written 74, and a SIGTERM or SIGINT before the work is done
75 (`plsc.process.startup`). Anything else is a bug and keeps its traceback."""
import argparse
import atexit
import errno
import json
import math
import os
import signal
import sys

from .process import startup
from .config import ConfigError, load_config
from .process.exits import CONFIG_ERROR_EXIT_CODE, DATA_ERROR_EXIT_CODE, IO_ERROR_EXIT_CODE

__all__ = ["config_parser", "add_onnx_options", "run_tool", "report_summary", "mistake",
           "report_mistake", "positive_int", "positive_float", "in_range", "FAR", "JPEG_QUALITY",
           "DATA_ERROR_EXIT_CODE"]


def in_range(kind, low, high=None, low_open=False, high_open=False, what=None):
    """An argparse `type=`: `kind(text)` (int or float) within [low, high] (`low_open`,
    `high_open`: the bound excluded; `high` None: no upper bound); anything else is argparse's
    one line `argument --x: expected <what>, got '...'` and exit code 2."""
    lo, hi = "(" if low_open else "[", ")" if high_open or high is None else "]"
    what = what or (f"{'an integer' if kind is int else 'a number'} in {lo}{low:g}, "
                    f"{'inf' if high is None else format(high, 'g')}{hi}")

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (low_open and value == low) or (
                high is not None and (value > high or (high_open and value == high))):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


positive_int = in_range(int, 1, what="a positive integer")
positive_float = in_range(float, 0, low_open=True, what="a positive number")
FAR = in_range(float, 0, 1, True, True, "a rate in (0, 1)")  # a FAR, an FPIR
JPEG_QUALITY = in_range(int, 0, 100, what="a JPEG quality in [0, 100]")

# OSErrors that are a mistake with a named file, not a bug: a missing path, a folder given for a
# file or a file for a folder, an output that exists (2); one that cannot be written (74).
_WRONG_PATH = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)
_CANNOT_WRITE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EIO}


def mistake(err, expected=()):
    """`(exit code, one line)` for an exception that is a user's mistake, None for a bug (which
    keeps its traceback): DataError (a damaged checkpoint too) 65; FolderInUse 73,
    FolderNotWritable 74; ConfigError, a missing path, a folder given for a file or the reverse,
    an output that exists, and the types `expected` 2; any other OSError that names its file (permission, read-only file
    system, disk full, I/O error) 74."""
    from .data.errors import DataError  # here: plsc.data imports Paddle, slow for --help
    from .checkpoint.lock import FolderInUse, FolderNotWritable
    if isinstance(err, DataError):
        return DATA_ERROR_EXIT_CODE, f"error: {err}"
    if isinstance(err, (FolderInUse, FolderNotWritable)):
        return err.exit_code, f"error: {err}"
    if isinstance(err, (ConfigError, *expected)):
        return CONFIG_ERROR_EXIT_CODE, f"error: {err}"
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        line = f"error: {err.filename}: {err.strerror}"
        if isinstance(err, _WRONG_PATH):
            return CONFIG_ERROR_EXIT_CODE, line
        if err.errno in _CANNOT_WRITE:
            return IO_ERROR_EXIT_CODE, line
    elif isinstance(err, _WRONG_PATH):  # raised with a message of its own
        return CONFIG_ERROR_EXIT_CODE, f"error: {err}"
    return None


def report_mistake(err, expected=()):
    """Print the one line of the mistake `err` (`mistake`) on stderr and return its exit code;
    None for a bug, which the caller re-raises (`except Exception as err: code =
    report_mistake(err); if code is None: raise`)."""
    known = mistake(err, expected)
    if known is not None:
        print(known[1], file=sys.stderr, flush=True)
        return known[0]
    return None


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
    own when it returns an int, e.g. a preempted training's). A mistake (`mistake`: a bad
    config, a missing file, an exception of the types `expected`, a bad image or record here or
    on another rank, an output folder in use or that cannot be written) prints one line and
    gives its code; any other exception keeps its traceback. A SIGTERM or SIGINT ends the run
    with one line (`plsc: preempted before <before>; nothing to save ...`) and 75, until
    training's own handling takes over (`plsc.process.startup`)."""
    startup.hold()  # before Paddle is imported (tools/train.py holds from its first line)
    from .distributed import launched_world_size
    startup.guard(before, wait_for_group=launched_world_size() > 1)
    try:
        code = task(load_config(args.config, args.override), *extra)
    except BaseException as err:
        code = report_mistake(err, expected) if isinstance(err, Exception) else None
        if code is None:
            startup.end()  # a crash: its traceback and status, not a preemption
            raise
    code = code if type(code) is int else 0
    if code:
        startup.settle()
        _keep_status_on_sigterm(code)
    startup.end()
    return code


def report_summary(make):
    """For a file-preparing tool without a config: call `make()`, print its summary (a dict) as
    one JSON line and give 0; a mistake (`mistake`: a bad input line or file, a missing input,
    an output that cannot be written) prints one line and gives its code. A SIGTERM or SIGINT
    meanwhile ends it with one line and 75 (`plsc.process.startup`; the tool holds them from
    its first line): its workers end with it, and what it was writing stays a temporary file
    that the next run removes."""
    startup.hold()
    startup.guard()
    try:
        summary = make()
    except Exception as err:
        code = report_mistake(err)
        if code is None:
            raise
        return code
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
