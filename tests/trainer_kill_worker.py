"""Trains with checkpoints every 3 steps and SIGKILLs itself in the middle of the second save.

    python tests/trainer_kill_worker.py DATA_ROOT OUTPUT_DIR
"""
import os
import signal
import sys

from trainer_common import config

import plsc.checkpoint.manager as checkpoint
from plsc.train import Trainer

saves = {"n": 0}
real_save_rows = checkpoint.write_rows_npy


def save_rows_then_die(path, array):
    written = real_save_rows(path, array)
    if "step_00000006" in path:  # the second checkpoint: die with its files half written
        os.kill(os.getpid(), signal.SIGKILL)
    return written


checkpoint.write_rows_npy = save_rows_then_die
Trainer(config(sys.argv[1], sys.argv[2])).train()
