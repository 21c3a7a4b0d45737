"""Batches of a map-style dataset, loaded in this process or in worker processes.

plsc's own loader rather than `paddle.io.DataLoader`: there, an exception in the dataset kills
the loading thread without closing its queue (num_workers=0: the process then waits forever)
or kills the queue under a reader that never returns (workers). Here an exception while loading
is a value like any batch: it reaches the main thread as a `DataError` naming the sample, at
the batch where it happened, and the workers are shut down.

Each worker collates its batch into a shared-memory slot (`plsc.data.slots`: a ring made
before the workers fork, one slot per batch in flight) and sends only a short message (the
batch number, the slot's field layout, the skipped samples or the error; pickled, after an
8-byte length) through a pipe of its own whose write end only that worker holds; a batch whose
fields are not arrays and numbers travels pickled in the message instead. The main process
copies each batch out of its slot into new tensors and hands the slot back. It reads the pipes
without blocking, waiting in
`multiprocessing.connection.wait` on the pipes and the workers' sentinels at most a second at a
time. So signals are handled, and a worker that dies (killed, out of memory) is noticed each
time the main thread asks for a batch (even one already received), also when it died in the
middle of writing a batch (into its slot, or a message into its pipe): the message is sent
only once the slot is written, its pipe ends, a half message is dropped and the death is a
`DataError`. Tasks (a few indices) go to the workers through one queue: a worker killed while
taking one may leave it locked for the others, but its death ends the iteration anyway.

Workers ignore SIGTERM and SIGINT (`ignore_stop_signals`): a stop belongs to the main process,
which ends its workers itself (a worker whose main process is gone ends within a second); a
worker that dies anyway is a `WorkerDied` naming how, which a stop in progress may claim.

Samples a dataset skipped (its `skip_bad` policy: replaced by the next good one) are reported
per batch to `on_skip` in the main process, whichever worker skipped them.
"""
import contextlib
import multiprocessing
import numbers
import os
import pickle
import queue
import signal
import struct
import time
import traceback
from multiprocessing.connection import wait

import numpy as np

from ..fileio import atomic_write
from ..process.startup import SIGNALS as STOP_SIGNALS
from .errors import DataError, WorkerDied
from .slots import Slots
from .tensors import to_tensor

__all__ = ["DataLoader", "collate", "forking", "ignore_stop_signals", "to_tensor"]

_POLL_SECONDS = 1.0  # how often a waiting main thread checks that its workers are alive
_HEADER = struct.Struct("<Q")  # a result message: its payload's length, then the pickled payload
_READ = 1 << 16  # bytes read from a result pipe at a time (what a Linux pipe holds)
# Test hook (tests/test_data_faults.py), "<batch number>:<file>": the worker making that batch
# writes half of it (into its slot, or half of its message when the batch travels pickled),
# writes its pid to <file> and sleeps until it is killed.
PAUSE_WRITE_HOOK = "PLSC_TEST_PAUSE_WRITE_AT"


def collate(samples):
    """Stack a list of samples (tuples of numpy arrays or numbers) field by field, as
    paddle.io's default collate does: arrays stacked, Python ints as int64, floats as float32."""
    fields = []
    for values in zip(*samples):
        first = values[0]
        if isinstance(first, np.ndarray):
            fields.append(np.stack(values))
        elif isinstance(first, numbers.Integral):
            fields.append(np.asarray(values, dtype=np.int64))
        elif isinstance(first, numbers.Real):
            fields.append(np.asarray(values, dtype=np.float32))
        else:
            raise TypeError(f"cannot batch a sample field of type {type(first).__name__}")
    return fields


def _take_skipped(dataset):
    """The messages of the samples `dataset` skipped since the last call (emptied)."""
    skipped = getattr(dataset, "skipped", None)
    if not skipped:
        return []
    taken = list(skipped)
    skipped.clear()
    return taken


def _describe(err, indices):
    """One line for an exception raised while loading `indices`: a DataError's own message
    (it names the file), else the exception with the samples' indices."""
    if isinstance(err, DataError):
        return str(err)
    return (f"{type(err).__name__} while loading samples {indices[0]}..{indices[-1]}: {err}")


def _load(dataset, indices):
    """(fields, skipped messages, None) of one batch, or (None, skipped, (message, traceback))."""
    try:
        fields = collate([dataset[i] for i in indices])
        return fields, _take_skipped(dataset), None
    except Exception as err:  # noqa: BLE001 -- every loading failure is reported, none kills us
        return None, _take_skipped(dataset), (_describe(err, indices), traceback.format_exc())


def _write(fd, data):
    """Write all of `data` to the pipe `fd` (os.write may take a part at a time)."""
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])


def _pause_hook():
    """(batch number, file) of the test hook PAUSE_WRITE_HOOK, or (None, None)."""
    number, _, path = os.environ.get(PAUSE_WRITE_HOOK, "").partition(":")
    return (int(number), path) if path else (None, None)


def _load_into(slots, slot, dataset, indices, pause):
    """(("slot", field layout) or fields, skipped messages, None) of one batch written into
    `slot`, or (None, skipped, (message, traceback)): `_load` with the slot as transport."""
    try:
        samples = [dataset[i] for i in indices]
        meta = slots.write(slot, samples, pause)
        fields = ("slot", meta) if meta is not None else collate(samples)
        return fields, _take_skipped(dataset), None
    except Exception as err:  # noqa: BLE001 -- every loading failure is reported, none kills us
        return None, _take_skipped(dataset), (_describe(err, indices), traceback.format_exc())


def _pause(parent, pause_file):
    """The test hook's pause: write our pid and sleep until killed (or orphaned); SIGTERM gets
    its default action back, so that a test can kill the worker with it alone."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    atomic_write(pause_file, str(os.getpid()))
    while os.getppid() == parent:
        time.sleep(_POLL_SECONDS)
    os._exit(0)


def ignore_stop_signals():
    """In a forked helper process (a loader worker, a pool process): SIGTERM and SIGINT are
    ignored, then unblocked (see `forking`). The main process owns a stop: a signal sent to
    the whole process group, or to every process of a job (`scancel`), must not kill the
    workers under it; it ends them itself, and an orphaned worker ends by itself."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def forking():
    """Fork helper processes inside: SIGTERM and SIGINT are blocked in this thread meanwhile,
    so a child inherits them blocked and none can land in it before `ignore_stop_signals`
    (a signal sent to this process meanwhile waits and is delivered when the block ends)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _worker(dataset, slots, tasks, out, parent, readers):
    ignore_stop_signals()
    for fd in readers:  # inherited read ends of the result pipes: only the main process reads
        os.close(fd)
    pause_at, pause_file = _pause_hook()
    while True:
        try:
            task = tasks.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            if os.getppid() != parent:  # the main process is gone (e.g. ended at once)
                return
            continue
        if task is None:
            return
        number, indices, slot = task
        pause = (lambda: _pause(parent, pause_file)) if number == pause_at else None
        result = _load_into(slots, slot, dataset, indices, pause)
        payload = pickle.dumps((number,) + result, pickle.HIGHEST_PROTOCOL)
        message = _HEADER.pack(len(payload)) + payload
        try:
            if pause is not None:  # the test hook, batch travelling pickled: half a message
                _write(out, message[:len(message) // 2])
                _pause(parent, pause_file)
            _write(out, message)
        except BrokenPipeError:  # the main process stopped reading: it is shutting us down
            return


class _Pipe:
    """The main process's end of one worker's result pipe: reads what is there, never waits."""

    def __init__(self, fd):
        self.fd, self.buffer = fd, bytearray()

    def read(self):
        """The messages completed by what the pipe holds now (it must be readable); EOFError
        when the worker's end is closed (it died), whatever part of a message was read."""
        chunk = os.read(self.fd, _READ)
        if not chunk:
            raise EOFError
        self.buffer += chunk
        messages = []
        while len(self.buffer) >= _HEADER.size:
            end = _HEADER.size + _HEADER.unpack_from(self.buffer)[0]
            if len(self.buffer) < end:
                break
            messages.append(pickle.loads(self.buffer[_HEADER.size:end]))
            del self.buffer[:end]
        return messages


class DataLoader:
    """Iterate the batches of `batch_sampler` (an iterable of index lists) over `dataset`
    (``dataset[i]`` returns a tuple of numpy arrays and numbers) in order, as tuples of Paddle
    tensors. `num_workers` processes (0: this process) load ahead up to `prefetch` batches
    each. `on_skip(messages)` receives the samples the dataset skipped, batch by batch.

    Each batch is a new set of tensors, unless `reuse` > 0: then batches are copied into
    `reuse` sets of tensors made once and used in turn (a fresh tensor costs page faults on
    every batch, far more than overwriting one: docs/performance.md), so a batch's tensors are
    overwritten `reuse` batches later -- only for a caller that holds fewer batches at once
    (the trainer: its micro-batches, plus one being prefetched)."""

    def __init__(self, dataset, batch_sampler, num_workers=0, prefetch=2, on_skip=None, reuse=0):
        self.dataset, self.batch_sampler = dataset, batch_sampler
        self.num_workers, self.prefetch = int(num_workers), max(1, int(prefetch))
        self.on_skip = on_skip
        self._sets, self._turn = [None] * max(0, int(reuse)), 0

    @classmethod
    def sequential(cls, dataset, batch_size, start=0, stop=None, **kw):
        """Samples [start, stop) of `dataset` in order, `batch_size` at a time (the last batch
        may be short)."""
        stop = len(dataset) if stop is None else stop
        batches = [list(range(lo, min(lo + batch_size, stop))) for lo in range(start, stop, batch_size)]
        return cls(dataset, batches, **kw)

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        if self.num_workers <= 0:
            for indices in self.batch_sampler:
                yield self._deliver(*_load(self.dataset, list(indices)))
            return
        yield from self._from_workers()

    def _deliver(self, fields, skipped, error, slots=None, slot=None):
        if isinstance(fields, tuple):  # ("slot", layout); collate's fields are a list
            fields = slots.read(slot, fields[1])  # views of the slot: copied out below
        if skipped and self.on_skip is not None:
            self.on_skip(skipped)
        if error is not None:
            raise DataError(error[0]) from _WorkerTraceback(error[1])
        if not self._sets:
            return tuple(to_tensor(f) for f in fields)
        turn, self._turn = self._turn, (self._turn + 1) % len(self._sets)
        old = self._sets[turn] or ()
        self._sets[turn] = tuple(to_tensor(f, old[k] if k < len(old) else None)
                                 for k, f in enumerate(fields))
        return self._sets[turn]

    def _from_workers(self):
        ctx = multiprocessing.get_context("fork")
        tasks, pipes, workers = ctx.Queue(), [], []
        slots = Slots(self.prefetch * self.num_workers)  # one per batch in flight
        free = list(range(len(slots.fds)))
        try:
            for _ in range(self.num_workers):
                read, write = os.pipe()
                pipes.append(_Pipe(read))
                workers.append(ctx.Process(target=_worker, daemon=True, args=(
                    self.dataset, slots, tasks, write, os.getpid(), [p.fd for p in pipes])))
                try:
                    with forking():
                        workers[-1].start()
                finally:
                    os.close(write)  # the worker's alone: its death ends the pipe
            batches = iter(enumerate(self.batch_sampler))
            sent = received = 0
            done = {}
            slot_of = {}
            for number, indices in batches:  # fill the pipeline
                slot_of[number] = free.pop()
                tasks.put((number, list(indices), slot_of[number]))
                sent += 1
                if sent >= self.prefetch * self.num_workers:
                    break
            while received < sent:
                self._receive(pipes, workers, done, 0)  # a death is noticed even with the batch here
                while received not in done:
                    self._receive(pipes, workers, done, _POLL_SECONDS)
                result, slot = done.pop(received), slot_of.pop(received)
                received += 1
                batch = self._deliver(*result, slots=slots, slot=slot)  # copied out of the slot
                free.append(slot)
                nxt = next(batches, None)
                if nxt is not None:
                    slot_of[nxt[0]] = free.pop()
                    tasks.put((nxt[0], list(nxt[1]), slot_of[nxt[0]]))
                    sent += 1
                yield batch
        finally:
            self._shutdown(workers, tasks, pipes)
            slots.close()

    @staticmethod
    def _receive(pipes, workers, done, timeout):
        """Wait at most `timeout` seconds for the pipes; put the batches they complete into `done`
        by number. DataError if a worker died: its sentinel is ready or its pipe ended (or, when
        nothing was ready, it has an exit status)."""
        ready = set(wait([p.fd for p in pipes] + [w.sentinel for w in workers], timeout))
        for pipe, worker in zip(pipes, workers):
            if worker.sentinel in ready:
                DataLoader._died(workers, worker)
            if pipe.fd in ready:
                try:
                    for number, *result in pipe.read():
                        done[number] = result
                except EOFError:
                    DataLoader._died(workers, worker)
            elif not ready and worker.exitcode is not None:
                DataLoader._died(workers, worker)

    @staticmethod
    def _died(workers, suspect):
        """Raise the `WorkerDied` naming the dead workers (`suspect` among them)."""
        suspect.join(_POLL_SECONDS)  # its pipe may end a moment before its exit status is known
        dead = [w for w in workers if w.exitcode is not None] or [suspect]
        raise WorkerDied([(w.pid, w.exitcode) for w in dead]) from None

    @staticmethod
    def _shutdown(workers, tasks, pipes):
        for _ in workers:
            tasks.put(None)
        for pipe in pipes:  # a worker blocked writing a batch gets EPIPE and exits
            os.close(pipe.fd)
        # After a death the task queue's lock may be held by the dead: no orderly end to wait for.
        died = any(w.pid is not None and w.exitcode not in (None, 0) for w in workers)
        for w in workers:
            if w.pid is None:  # never started
                continue
            w.join(timeout=0 if died else 2)
            if w.is_alive():
                w.kill()
                w.join()
        tasks.cancel_join_thread()
        tasks.close()


class _WorkerTraceback(Exception):
    """The traceback of a loading failure, as text (shown as the cause of the DataError)."""

    def __str__(self):
        return "\n" + self.args[0]
