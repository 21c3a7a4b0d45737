"""Opt-in per-phase step timers of the Trainer: where each optimizer step's wall time goes.

With the environment variable ``PLSC_STEP_TIMES=PREFIX`` set, `Trainer.train` records every
step on every rank and writes ``PREFIX.rank<r>.json`` when it ends (returns or raises).
Without it nothing is installed: the step runs exactly the same code. When on, the timers
wrap some of the trainer's methods on the instance (and its optimizers'), hook the
backbone's forward and its output's gradient, and time every call into ``paddle.distributed``
made by `plsc.distributed.collective`; all of it is undone when `train` ends.

Each phase is exclusive wall time of the rank's main thread (a phase entered inside another
pauses the outer one), so the phases of a step add up to its wall time:

- ``data``: waiting for the loader's next batch (and starting the loader at an epoch's start);
- ``backbone``: the images' normalisation, the backbone's forward, and the backward below the
  embedding (the backbone's gradients; the gradient all-reduces it starts are ``collectives``);
- ``head``: the margin softmax's forward and backward down to the embedding's gradient (with
  the head's fused row update, when the update is fused into the backward);
- ``collectives``: blocked in a collective, waiting for the slowest rank included (the head's
  all-gathers and reductions, the per-step stop agreement) and the backbone's gradient sum
  (copying gradients into and out of its buckets, starting and waiting for their all-reduces);
- ``optimizer``: the backbone optimizer's step (gradient clipping included) and the head's
  update after the backward;
- ``checks_logging``: everything else of the step: finite checks, the one loss read, the log
  line and VisualDL, the loop itself;
- ``checkpoint_eval``: checkpoints and evaluations (a step's ``wall_s`` leaves them out; they
  are in ``checkpoint_eval_s``).

Beside the phases, each step records its backbone gradient all-reduces (`OverlappedSum.timing`):
``grad_sum_ran_s``, how long they ran as far as seen; ``grad_sum_exposed_s``, how long the main
thread was blocked in them (part of ``collectives``); ``grad_sum_hidden_s``, of each one's
run the part the main thread did not wait for, summed: what ran behind the backward (on the
communication thread of ``Optimizer.grad_sync: thread``; ``ran`` minus ``hidden`` is at most
``exposed``, which also holds the thread's hand-over latency; gloo
runs a ``backward`` all-reduce to its end inside the hook, so all of it is exposed there);
``grad_sum_buckets_in_backward``, how many buckets the backward's hooks sent. Collectives
called from another thread than the one timing the steps are not timed as a phase.

A step runs from the end of the previous one (the first: from its first fetch) to the end of
its checks after the update. The file also holds the rank's peak resident memory (VmHWM) as
`train` ends.
"""
import contextlib
import json
import os
import threading
import time

from ..fileio import atomic_write

__all__ = ["ENV", "PHASES", "StepTimers", "step_timers", "peak_rss_bytes"]

ENV = "PLSC_STEP_TIMES"
PHASES = ("data", "backbone", "head", "collectives", "optimizer", "checks_logging")
_EXCLUDED = "checkpoint_eval"
_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all")


def peak_rss_bytes(pid="self"):
    """VmHWM of process `pid` (this one by default) in bytes, or None where /proc has none."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f
                         if line.startswith("VmHWM")), None)
    except OSError:
        return None


class StepTimers:
    """A stack of phases; the time between two changes goes to the phase on top."""

    def __init__(self, rank, world, global_batch, clock=time.perf_counter):
        self.rank, self.world, self.global_batch, self.clock = rank, world, global_batch, clock
        self.steps = []
        self._stack, self._t, self._start = [], None, None
        self._totals = dict.fromkeys(PHASES + (_EXCLUDED,), 0.0)
        self.thread = threading.get_ident()  # the thread whose time the phases share

    def _accrue(self):
        now = self.clock()
        if self._stack:
            self._totals[self._stack[-1]] += now - self._t
        self._t = now
        return now

    def enter(self, phase):
        now = self._accrue()
        if self._start is None:  # the first step starts at the first phase entered
            self._start, self._stack = now, ["checks_logging"]
        self._stack.append(phase)

    def leave(self):
        self._accrue()
        self._stack.pop()

    @property
    def top(self):
        """The phase time goes to now (None before the first step)."""
        return self._stack[-1] if self._stack else None

    def switch(self, old, new):
        """The phase on top becomes `new`, if it is `old` (hooks that also run outside a step)."""
        if self.top == old:
            self._accrue()
            self._stack[-1] = new

    @contextlib.contextmanager
    def phase(self, name):
        self.enter(name)
        try:
            yield
        finally:
            self.leave()

    def end_step(self, step, extra=None):
        """Close step `step`'s record, with the values of `extra` ({name: number}) added."""
        now = self._accrue()
        if self._start is None:
            return
        excluded = self._totals.pop(_EXCLUDED)
        record = {"step": int(step), "wall_s": now - self._start - excluded,
                  "checkpoint_eval_s": excluded}
        record.update(self._totals)
        record.update(extra or {})
        self.steps.append(record)
        self._totals = dict.fromkeys(PHASES + (_EXCLUDED,), 0.0)
        self._start, self._stack = now, ["checks_logging"]

    def report(self):
        return {"rank": self.rank, "world": self.world, "global_batch": self.global_batch,
                "phases": list(PHASES), "steps": self.steps, "vm_hwm_bytes": peak_rss_bytes(),
                "pid": os.getpid()}


class _TimedTask:
    """An asynchronous collective's task whose `wait` counts as ``collectives``."""

    def __init__(self, task, timers):
        self._task, self._timers = task, timers

    def wait(self, *args, **kwargs):
        with self._timers.phase("collectives"):
            return self._task.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._task, name)


class _TimedDist:
    """``paddle.distributed`` as `plsc.distributed.collective` sees it, its collectives timed."""

    def __init__(self, dist, timers):
        self._dist, self._timers = dist, timers

    def __getattr__(self, name):
        attr = getattr(self._dist, name)
        if name not in _COLLECTIVES:
            return attr

        def timed(*args, **kwargs):
            if threading.get_ident() != self._timers.thread:  # e.g. the gradient sum's thread
                return attr(*args, **kwargs)
            with self._timers.phase("collectives"):
                task = attr(*args, **kwargs)
            return (_TimedTask(task, self._timers)
                    if kwargs.get("sync_op", True) is False and task is not None else task)
        return timed


def _wrap(obj, name, before, after, undo):
    """Replace `obj.name` on the instance by a call of `before()`, the original, `after()`."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        before()
        try:
            return original(*args, **kwargs)
        finally:
            after()
    setattr(obj, name, wrapper)
    undo.append(lambda: delattr(obj, name))


def _gradient_sum(summer):
    """The step record's ``grad_sum_*`` values from `OverlappedSum.timing`."""
    t = summer.timing()
    return {"grad_sum_ran_s": t["ran_s"], "grad_sum_exposed_s": t["waited_s"],
            "grad_sum_hidden_s": t["hidden_s"], "grad_sum_buckets_in_backward": t["in_backward"]}


def _install(trainer, timers):
    """Hook `timers` into `trainer`; returns the list of functions that undo it."""
    from ..distributed import collective
    undo = []
    phases = {"_fetch": "data", "_loader": "data", "_forward_backward": "backbone",
              "optimizer_step": "checks_logging", "save": _EXCLUDED, "evaluate": _EXCLUDED}
    for name, phase in phases.items():
        _wrap(trainer, name, lambda p=phase: timers.enter(p), timers.leave, undo)
    for opt, names in ((trainer.backbone_opt, ("step",)),
                       (trainer.head_opt, ("step", "end_fused_step", "discard"))):
        for name in names:
            _wrap(opt, name, lambda: timers.enter("optimizer"), timers.leave, undo)
    for name in ("_send", "finish"):  # the backbone's gradient sum: bucket copies, sends, waits
        _wrap(trainer.gradient_sum, name, lambda: timers.enter("collectives"), timers.leave, undo)
    _wrap(trainer, "_after_step", lambda: None,
          lambda: timers.end_step(trainer.step, _gradient_sum(trainer.gradient_sum)), undo)

    def embedding_ready(grad):  # the head's backward has reached the embedding
        timers.switch("head", "backbone")

    def backbone_done(layer, inputs, output):
        if not output.stop_gradient and timers.top == "backbone":
            output.register_hook(embedding_ready)
            timers.switch("backbone", "head")
    hook = trainer.backbone.register_forward_post_hook(backbone_done)
    undo.append(hook.remove)
    dist = collective.dist
    collective.dist = _TimedDist(dist, timers)
    undo.append(lambda: setattr(collective, "dist", dist))
    return undo


@contextlib.contextmanager
def step_timers(trainer, environ=None):
    """Within it, `trainer`'s steps are timed when ``PLSC_STEP_TIMES`` (in `environ`, default
    `os.environ`) is set; yields the `StepTimers` or None. Writes the report at the end."""
    prefix = (os.environ if environ is None else environ).get(ENV)
    if not prefix:
        yield None
        return
    timers = StepTimers(trainer.rank, trainer.world, trainer.global_batch)
    undo = _install(trainer, timers)
    try:
        yield timers
    finally:
        for fn in reversed(undo):
            fn()
        atomic_write(f"{prefix}.rank{trainer.rank}.json", json.dumps(timers.report()))
