"""A one-line progress bar on stderr, shared by the extraction tasks."""
import sys

__all__ = ["progress"]


def progress(done, total, enabled, label=""):
    """Draw `done`/`total` (ends the line when done >= total); nothing unless `enabled`."""
    if enabled:
        width = 30
        fill = width * done // max(total, 1)
        sys.stderr.write(f"\r{label}[{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()
