"""tools/train.py with a hook for the preemption tests.

    python tests/preempt_worker.py SIGNAL_RANK SIGNAL_STEP SLEEP -c CONFIG [-o ...]

After optimizer step SIGNAL_STEP, the rank SIGNAL_RANK sends SIGTERM to itself (-1: no
rank does); every step then sleeps SLEEP seconds (so that a signal from outside finds the
run in the middle of its steps). Environment: PREEMPT_SIGNAL=KILL sends SIGKILL instead;
PREEMPT_ONCE=FILE signals only while FILE does not exist, and creates it (a restarted run
then goes through).
"""
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from plsc.train.trainer import Trainer  # noqa: E402

signal_rank, signal_step, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
signum = getattr(signal, "SIG" + os.environ.get("PREEMPT_SIGNAL", "TERM"))
once = os.environ.get("PREEMPT_ONCE")
real_after_step = Trainer._after_step


def after_step(self):
    real_after_step(self)
    if self.rank == signal_rank and self.step == signal_step:
        if once is None or not os.path.exists(once):
            if once is not None:
                open(once, "w").close()
            os.kill(os.getpid(), signum)
    time.sleep(pause)


Trainer._after_step = after_step
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
import train  # noqa: E402

sys.exit(train.main(sys.argv[4:]))
