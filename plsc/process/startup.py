"""Stop signals (SIGTERM, SIGINT) from a tool's first line to training's first step: one
line and exit status 75 (`PREEMPTED_EXIT_CODE`), whenever the signal comes. Importing this
module does not import Paddle.

**Why not Paddle's handler.** `import paddle` installs glog's failure handler for SIGTERM
(`paddle::framework::SignalHandle`): it formats a C++ stack with malloc, so a SIGTERM that
lands while a thread is inside malloc deadlocks the process (seen during the import, which
registers kernels), and otherwise the process dies with -15 and no line. Python's
`signal.signal` replaces it (one sigaction for the process; measured).

**How.** `hold()`, an entry point's first statement, blocks both signals in the main thread;
the threads Paddle, gloo and OpenMP start while Paddle is imported inherit the block, so no
thread can receive one while Paddle's handler is in place. `guard()`, after the import, puts
Python's handler in its place and unblocks the main thread: a signal that came meanwhile is
delivered then. Python's C-level handler only notes the signal and writes its number to the
wake-up pipe (async-signal-safe); a thread reads the pipe, prints the line and ends the
process with `os._exit` (nothing to save before the first step, and nothing half-done is
read again: checkpoints and packs are written to temporary names). The thread runs even while
the main thread waits in a call that releases the GIL; Paddle's process-group set-up holds it,
so a signal there takes effect when the set-up returns.

**Several ranks.** Until the process group is formed (`group_ready`, called by
`runtime.start` once `plsc.distributed.init` returns) a signal is kept, not acted on: a rank
that left before the set-up would leave the others waiting in it (Paddle's store waits up to
900 s, holding the GIL). Ranks signalled together therefore all form the group and all end
with 75; a rank that was not signalled meets the missing rank at its next collective (exit
69). While kept, a second signal ends the process at once (128 + n), as in training.

**Hand-over.** Training's `StopSignals` takes over when its loop starts (`hand_over`): from
there every rank stops at the same step. Other tools keep the guard to their end (`end`). Once
a run is ending with its own status (`settle`), stop signals are ignored until `end`.
"""
import os
import signal
import sys
import threading
import time

from .exits import PREEMPTED_EXIT_CODE, signal_exit_code

__all__ = ["PREEMPTED_EXIT_CODE", "SIGNALS", "BURST_SECONDS", "hold", "guard", "group_ready",
           "settle", "hand_over", "end", "preempted_message", "same_request", "end_at_once"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)
BURST_SECONDS = 1.0  # stop signals this soon after the first repeat it (`same_request`)
LAUNCHED_ENV = "PADDLE_TRAINER_ID"  # set in every rank Paddle's launcher starts (and by
# plsc.distributed.slurm in a task of srun, where srun and scancel repeat SIGTERMs too)


def preempted_message(signum, before=None):
    """The line of a run stopped by `signum` with nothing to save, e.g. `preempted before the
    first step; nothing to save (signal 15, SIGTERM); run the same command again`."""
    when = f" before {before}" if before else ""
    return (f"preempted{when}; nothing to save (signal {int(signum)}, "
            f"{signal.Signals(signum).name}); run the same command again")


def same_request(first, signum, elapsed):
    """Whether stop signal `signum`, `elapsed` seconds after a first one `first`, repeats it
    rather than insisting (which ends the process at once). SIGINT after SIGINT insists
    (Ctrl-C twice). In a rank started by Paddle's launcher a SIGTERM always repeats: the
    launcher, itself stopped (SIGTERM, or Ctrl-C's SIGINT), sends each rank's process group up
    to three SIGTERMs 0.2 s apart, one rank after the other (rank 7 of 8 hears its first about
    4 s after rank 0), on top of a scheduler's own signal to every process of the job
    (`scancel`); a person's second signal goes to the launcher, which kills the ranks 10 s
    later. Elsewhere any stop signal within `BURST_SECONDS` of the first repeats it."""
    if signum == signal.SIGINT == first:
        return False
    if signum == signal.SIGTERM and LAUNCHED_ENV in os.environ:
        return True
    return elapsed < BURST_SECONDS


def end_at_once(signum, note=""):
    """A second stop signal: one line, then exit at once with status 128 + `signum`."""
    name = signal.Signals(signum).name
    _write_line(f"plsc: second stop signal ({name}): ending at once{note}")
    os._exit(signal_exit_code(signum))


def _write_line(text):
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        os.write(2, (text + "\n").encode())
    except OSError:  # no stderr: the status still says it
        pass


def _noted(signum, frame):
    """The guard's Python handler: the wake-up pipe's reader acts."""


class _Guard:
    def __init__(self, before, wait_for_group):
        self.before = before  # what signal.signal returned, to put back
        self.waiting = wait_for_group
        self.settled = False  # the run ends with its own status: signals are ignored
        self.handed = False  # StopSignals took over: signals still read go to it (`late`)
        self.first = None  # (signum, monotonic time) of the first signal kept
        self.late = []
        self.lock = threading.Lock()
        self.before_fd = -1
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.thread = threading.Thread(target=self.watch, daemon=True,
                                       name="plsc-startup-signals")

    def watch(self):
        with os.fdopen(self.read_fd, "rb", buffering=0) as pipe:
            while True:
                data = pipe.read(64)
                if not data:
                    return
                for signum in data:
                    if signum in SIGNALS:
                        self.signal(signum)

    def signal(self, signum):
        with self.lock:
            if self.handed:
                self.late.append(signum)
                return
            # Ignored: the run ends by itself, or another handler owns the signal now.
            if self.settled or signal.getsignal(signum) is not _noted:
                return
            now = time.monotonic()
            if self.first is None:
                self.first = (signum, now)
                if not self.waiting:
                    _preempted(signum)
            elif not same_request(self.first[0], signum, now - self.first[1]):
                end_at_once(signum)

    def restore(self):
        """Handlers and wake-up fd as they were before the guard, where they are still its."""
        for sig, before in self.before.items():
            if signal.getsignal(sig) is _noted:
                signal.signal(sig, before)
        current = signal.set_wakeup_fd(self.before_fd)
        if current != self.write_fd:  # not the guard's: leave it
            signal.set_wakeup_fd(current)


_guard = None
_before = None  # the message's "before ..." of the active guard
_fork_hook = False


def hold():
    """Block SIGTERM and SIGINT in this thread and in the threads it starts from now on (call
    it first, before anything imports Paddle). `guard` or `end` unblocks them."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def _unblock():
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def guard(before=None, wait_for_group=False):
    """From now on the first SIGTERM or SIGINT prints `plsc: preempted before <before>; nothing
    to save ...` and ends the process with `PREEMPTED_EXIT_CODE`; a signal held by `hold` is
    delivered now. Call it after Paddle is imported (it replaces Paddle's handler), in the main
    thread. `wait_for_group`: keep a signal until `group_ready` (a launched rank)."""
    global _guard, _before, _fork_hook
    if _guard is not None or threading.current_thread() is not threading.main_thread():
        _unblock()
        return
    before_handlers = {}
    for sig in SIGNALS:
        previous = signal.signal(sig, _noted)
        before_handlers[sig] = previous if previous is not None else signal.SIG_DFL
    g = _Guard(before_handlers, wait_for_group)
    g.before_fd = signal.set_wakeup_fd(g.write_fd, warn_on_full_buffer=False)
    g.thread.start()
    _guard, _before = g, before
    if not _fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_in_child)
        _fork_hook = True
    _unblock()


def _preempted(signum):
    _write_line("plsc: " + preempted_message(signum, _before))
    os._exit(PREEMPTED_EXIT_CODE)


def group_ready():
    """The process group is formed (or its set-up failed): a signal kept meanwhile ends the
    process now."""
    g = _guard
    if g is None:
        return
    with g.lock:
        g.waiting = False
        if g.first is not None and not g.settled:
            _preempted(g.first[0])


def settle():
    """The run is ending with a status of its own (e.g. another rank was lost): stop signals
    are ignored until `end`, so that they do not turn it into 75."""
    g = _guard
    if g is not None:
        with g.lock:
            g.settled = True


def hand_over():
    """Training's `StopSignals`, its handlers and wake-up pipe installed, takes over: the guard
    ends. Returns (the handlers and the wake-up fd the guard replaced, which StopSignals puts
    back at its end; a signal the guard received and did not act on, or 0), or None without a
    guard. The guard's pipe is read to its end first, so a signal that came just before the
    switch is not lost."""
    global _guard
    g, _guard = _guard, None
    if g is None:
        return None
    with g.lock:
        g.handed = True
    os.close(g.write_fd)
    g.thread.join(5.0)  # it reads what is left and ends (end of file)
    with g.lock:
        kept = [g.first[0]] if g.first is not None else []
        kept += g.late
    return g.before, g.before_fd, (kept[0] if kept else 0)


def end():
    """The tool is done (or ends with its own status): SIGTERM and SIGINT get back the handlers
    they had before `guard` (unless replaced since) and are unblocked."""
    global _guard
    g, _guard = _guard, None
    if g is not None:
        with g.lock:
            g.settled = True
        if threading.current_thread() is threading.main_thread():
            g.restore()
        os.close(g.write_fd)
    _unblock()


def _forget_in_child():
    """A forked child (a loader worker, a helper process) does not act as the guard: its
    signals would otherwise be written into this process's wake-up pipe."""
    global _guard
    g, _guard = _guard, None
    if g is None:
        return
    try:
        signal.set_wakeup_fd(-1)
        for sig, before in g.before.items():
            signal.signal(sig, before)
    except (ValueError, OSError):
        pass
    for fd in (g.read_fd, g.write_fd):  # else the parent's reader never sees the pipe's end
        try:
            os.close(fd)
        except OSError:
            pass
