"""Batches of a map-style dataset, loaded in this process or in worker processes.

plsc's own loader rather than `paddle.io.DataLoader`: there, an exception in the dataset kills
the loading thread without closing its queue (num_workers=0: the process then waits forever)
or kills the queue under a reader that never returns (workers). Here an exception while loading
is a value like any batch: it reaches the main thread as a `DataError` naming the sample, at
the batch where it happened, and the workers are shut down. The main thread only ever waits
in `queue.get` with a timeout, so signals are handled and a worker that dies (killed, out of
memory) is noticed within a second.

Samples a dataset skipped (its `skip_bad` policy: replaced by the next good one) are reported
per batch to `on_skip` in the main process, whichever worker skipped them.
"""
import multiprocessing
import numbers
import os
import queue
import signal
import traceback

import numpy as np
import paddle

from .errors import DataError

__all__ = ["DataLoader", "collate"]

_POLL_SECONDS = 1.0  # how often a waiting main thread checks that its workers are alive


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


def _worker(dataset, tasks, results, parent):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    results.cancel_join_thread()  # told to stop, exit at once even with a batch still unread
    while True:
        try:
            task = tasks.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            if os.getppid() != parent:  # the main process is gone (e.g. ended at once)
                return
            continue
        if task is None:
            return
        number, indices = task
        results.put((number,) + _load(dataset, indices))


class DataLoader:
    """Iterate the batches of `batch_sampler` (an iterable of index lists) over `dataset`
    (``dataset[i]`` returns a tuple of numpy arrays and numbers) in order, as tuples of Paddle
    tensors. `num_workers` processes (0: this process) load ahead up to `prefetch` batches
    each. `on_skip(messages)` receives the samples the dataset skipped, batch by batch."""

    def __init__(self, dataset, batch_sampler, num_workers=0, prefetch=2, on_skip=None):
        self.dataset, self.batch_sampler = dataset, batch_sampler
        self.num_workers, self.prefetch = int(num_workers), max(1, int(prefetch))
        self.on_skip = on_skip

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

    def _deliver(self, fields, skipped, error):
        if skipped and self.on_skip is not None:
            self.on_skip(skipped)
        if error is not None:
            raise DataError(error[0]) from _WorkerTraceback(error[1])
        return tuple(paddle.to_tensor(f) for f in fields)

    def _from_workers(self):
        ctx = multiprocessing.get_context("fork")
        tasks, results = ctx.Queue(), ctx.Queue()
        workers = [ctx.Process(target=_worker, args=(self.dataset, tasks, results, os.getpid()), daemon=True)
                   for _ in range(self.num_workers)]
        for w in workers:
            w.start()
        try:
            batches = iter(enumerate(self.batch_sampler))
            sent = received = 0
            done = {}
            for number, indices in batches:  # fill the pipeline
                tasks.put((number, list(indices)))
                sent += 1
                if sent >= self.prefetch * self.num_workers:
                    break
            while received < sent:
                while received not in done:
                    number, *result = self._get(results, workers)
                    done[number] = result
                result = done.pop(received)
                received += 1
                nxt = next(batches, None)
                if nxt is not None:
                    tasks.put((nxt[0], list(nxt[1])))
                    sent += 1
                yield self._deliver(*result)
        finally:
            self._shutdown(workers, tasks, results)

    @staticmethod
    def _get(results, workers):
        while True:
            try:
                return results.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                dead = [w for w in workers if w.exitcode is not None]
                if dead:
                    how = ", ".join(f"pid {w.pid} " + (f"killed by signal {-w.exitcode}" if w.exitcode < 0
                                                       else f"exit status {w.exitcode}") for w in dead)
                    raise DataError(f"a data loader worker died ({how}); if it ran out of memory, "
                                    "lower Data.num_workers or Data.batch_size") from None

    @staticmethod
    def _shutdown(workers, tasks, results):
        for _ in workers:
            tasks.put(None)
        for w in workers:
            w.join(timeout=2)
            if w.is_alive():
                w.kill()
                w.join()
        for q in (tasks, results):
            q.cancel_join_thread()
            q.close()


class _WorkerTraceback(Exception):
    """The traceback of a loading failure, as text (shown as the cause of the DataError)."""

    def __str__(self):
        return "\n" + self.args[0]
