"""Load the next batch in a background thread while the current step runs.

`Prefetcher(loader)` iterates a `plsc.data.DataLoader` in a thread of its own, `depth` batches
ahead: the thread receives each batch from the workers and copies it into its tensors on the
device (the loader builds them on Paddle's current device, which the thread sets for itself),
so the step that follows does not wait for the copy; with no workers the thread also decodes
and collates. What the thread raises (a `DataError` naming the sample, a dead worker) reaches
the caller at the batch where it happened, as from the loader itself. Samples the dataset
skipped are handed to the loader's `on_skip` in the caller's thread when their batch is taken,
not when it is loaded, so a step that is never taken does not count them. The main thread never
waits without a timeout; `close()` (or the end of the iteration) stops the thread and then the
loader's workers.
"""
import queue
import threading

import paddle

__all__ = ["Prefetcher"]

_POLL_SECONDS = 1.0
_END = object()


class Prefetcher:
    """Iterate `loader` (a DataLoader) `depth` batches ahead in a background thread."""

    def __init__(self, loader, depth=1):
        self.loader, self.on_skip = loader, loader.on_skip
        self.depth = max(1, int(depth))
        self._thread = None

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        if self._thread is not None:  # one pass: iterating again continues it
            return self
        self._queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._skipped = []
        self.loader.on_skip = self._skipped.extend  # runs in the thread, with its batch
        self._batches = iter(self.loader)
        self._thread = threading.Thread(target=self._run, args=(paddle.get_device(),),
                                        name="plsc-prefetch", daemon=True)
        self._thread.start()
        return self

    def _put(self, item):
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, device):
        try:
            paddle.set_device(device)
            while not self._stop.is_set():
                try:
                    batch = next(self._batches)
                except StopIteration:
                    self._put((_END, None, None))
                    return
                skipped, self._skipped[:] = list(self._skipped), []
                if not self._put((batch, skipped, None)):
                    return
        except BaseException as err:  # noqa: BLE001 -- handed to the caller, raised there
            skipped, self._skipped[:] = list(self._skipped), []
            self._put((None, skipped, err))
        finally:
            self._batches.close()  # the loader's workers end in the thread that ran it

    def __next__(self):
        if self._thread is None:
            iter(self)
        while True:
            try:
                batch, skipped, err = self._queue.get(timeout=_POLL_SECONDS)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch thread ended without a batch or an error") from None
        if skipped and self.on_skip is not None:
            self.on_skip(skipped)
        if err is not None:
            self._stop.set()
            raise err
        if batch is _END:
            self._stop.set()
            raise StopIteration
        return batch

    def close(self):
        """Stop the thread (it finishes the batch it is loading) and the loader's workers."""
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:  # make room for a put the thread may be blocked in
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)
