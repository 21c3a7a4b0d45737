"""When a progress bar is drawn (`show_progress`) and drawing it (`progress`), for training's
log and the applications alike."""
import sys

__all__ = ["show_progress", "progress"]


def show_progress(requested=None, setting=True, rank=0, stream=None):
    """Whether this process draws a progress bar: on rank 0 only; `requested` (True/False)
    when given, else `setting` (Logging.progress_bar) and `stream` (default stderr) being a
    terminal."""
    if rank != 0:
        return False
    if requested is not None:
        return bool(requested)
    return bool(setting) and (stream or sys.stderr).isatty()


def progress(done, total, enabled, label=""):
    """Draw `done`/`total` as a one-line bar on stderr (ending the line when done >= total);
    nothing unless `enabled`."""
    if enabled:
        width = 30
        fill = width * done // max(total, 1)
        sys.stderr.write(f"\r{label}[{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()
