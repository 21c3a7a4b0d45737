"""tools/train.py with a hook for the preemption tests.

    python tests/preempt_worker.py SIGNAL_RANK SIGNAL_STEP SLEEP -c CONFIG [-o ...]

After optimizer step SIGNAL_STEP, the rank SIGNAL_RANK sends SIGTERM to itself (-1: no
rank does, -2: every rank does); every step then sleeps SLEEP seconds (so that a signal from
outside finds the run in the middle of its steps). Environment: PREEMPT_SIGNAL=KILL sends
SIGKILL instead; PREEMPT_ONCE=FILE signals only while FILE does not exist, and creates it (a
restarted run then goes through). PREEMPT_AT moves the signal into start-up (SIGNAL_STEP is
then not used): `init` at the end of Trainer.__init__, `agree` just before the training
loop's first agreement (the last moment before the first step), `verify` inside the
checkpoint agreement of a resume, one second after the rank's verification began (the other
rank is then waiting in the agreement's collective).
"""
import os
import signal
import sys
import time

import scripts
from plsc.process import ending, startup

startup.hold()  # as tools/train.py does, before Paddle is imported

from plsc.checkpoint import manager  # noqa: E402
from plsc.train import preemption  # noqa: E402
from plsc.train.trainer import Trainer  # noqa: E402

signal_rank, signal_step, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
signum = getattr(signal, "SIG" + os.environ.get("PREEMPT_SIGNAL", "TERM"))
once = os.environ.get("PREEMPT_ONCE")
at = os.environ.get("PREEMPT_AT", "step")
rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def send(wait=0.5):
    """Signal this process if it is the rank; `wait`: then give the handler time (in start-up
    the run must end here)."""
    if signal_rank in (rank, -2) and (once is None or not os.path.exists(once)):
        if once is not None:
            open(once, "w").close()
        os.kill(os.getpid(), signum)
        time.sleep(wait)


if at == "step":
    real_after_step = Trainer._after_step

    def after_step(self):
        real_after_step(self)
        if self.step == signal_step:
            send(wait=0)
        time.sleep(pause)
    Trainer._after_step = after_step
elif at == "init":
    real_init = Trainer.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        send()
    Trainer.__init__ = init
elif at == "agree":
    real_agree = preemption.StopSignals.agree

    def agree(self, *args, **kwargs):
        if not getattr(self, "_hooked", False):
            self._hooked = True
            send()
        return real_agree(self, *args, **kwargs)
    preemption.StopSignals.agree = agree
elif at == "verify":
    real_verify = manager.verify_checkpoint

    def verify(*args, **kwargs):
        if signal_rank in (rank, -2):
            time.sleep(1.0)
        send()
        return real_verify(*args, **kwargs)
    manager.verify_checkpoint = verify

ending.end(scripts.load("tools/train.py").main(sys.argv[4:]))
