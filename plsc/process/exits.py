"""Every exit status plsc's tools end with, in one table (the sysexits.h name where one fits).
Importing this module imports nothing, so any module may use it, before Paddle loads too.

A second stop signal ends a process at once with `signal_exit_code(signum)` (128 + its
number, as a shell reports a process a signal ended)."""

__all__ = ["CONFIG_ERROR_EXIT_CODE", "DATA_ERROR_EXIT_CODE", "RANK_LOST_EXIT_CODE", "DIVERGED_EXIT_CODE",
           "IN_USE_EXIT_CODE", "IO_ERROR_EXIT_CODE", "PREEMPTED_EXIT_CODE", "DOES_NOT_FIT_EXIT_CODE",
           "signal_exit_code"]

CONFIG_ERROR_EXIT_CODE = 2  # a bad config, option or argument, or a missing input (argparse's status)
DATA_ERROR_EXIT_CODE = 65  # EX_DATAERR: an input file is malformed
RANK_LOST_EXIT_CODE = 69  # EX_UNAVAILABLE: a rank this one needs is gone
DIVERGED_EXIT_CODE = 70  # EX_SOFTWARE: the run cannot go on as configured
IN_USE_EXIT_CODE = 73  # EX_CANTCREAT: the output folder is in use by another job
IO_ERROR_EXIT_CODE = 74  # EX_IOERR: an error while writing a file
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later", which a re-queued job does
DOES_NOT_FIT_EXIT_CODE = 78  # EX_CONFIG: a valid config the device cannot hold (tools/plan.py)


def signal_exit_code(signum):
    """The status of a process ended at once by signal `signum`: 128 + its number."""
    return 128 + int(signum)
