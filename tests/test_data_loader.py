"""plsc.data.DataLoader's shared-memory transport delivers exactly the batches a plain in-process
stack of the dataset's samples gives (the oracle below), in order, with 0, 1 and 2 workers, and
keeps its guarantees: failures are DataErrors naming the samples, a killed worker is noticed,
skipped samples are reported, a mid-epoch start continues the same order, workers end with the
iterator, and no Python objects pile up per batch."""
import contextlib
import gc
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from plsc.data import DataError, DataLoader
from plsc.data.slots import Slots

BATCH = 4


class Faces:
    """40 HWC uint8 'images' (a per-index seeded pattern), a float and an int label; sample
    `bad` raises, sample `skip` is replaced by the next one and reported (skip_bad)."""

    def __init__(self, n=40, size=(24, 20), bad=None, skip=None):
        self.n, self.size, self.bad, self.skip, self.skipped = n, size, bad, skip, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError("boom")
        if i == self.skip:
            self.skipped.append(f"sample {i} is bad")
            i += 1
        img = np.random.default_rng(i).integers(0, 256, self.size + (3,), dtype=np.uint8)
        return img, float(i) / 7, i


def oracle(ds, batches):
    """The batches as numpy arrays, stacked in this process without the loader."""
    out = []
    for b in batches:
        ds.skipped = []
        samples = [ds[i] for i in b]
        out.append((np.stack([s[0] for s in samples]), np.array([s[1] for s in samples], np.float32),
                    np.array([s[2] for s in samples], np.int64)))
    return out


def batches_of(n, order=None):
    order = list(range(n)) if order is None else order
    return [order[i:i + BATCH] for i in range(0, len(order), BATCH)]


def check_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert len(g) == 3
        for gf, wf in zip(g, w):
            arr = gf.numpy()
            assert arr.dtype == wf.dtype and arr.shape == wf.shape
            np.testing.assert_array_equal(arr, wf)


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_same_batches_in_the_same_order(workers):
    order = list(np.random.default_rng(3).permutation(37))  # a short last batch
    batches = batches_of(37, order)
    got = list(DataLoader(Faces(), batches, num_workers=workers))
    check_equal(got, oracle(Faces(), batches))


def test_the_images_travel_through_the_slots():
    """The uint8 images are written into a slot (not pickled) and read back equal."""
    slots = Slots(1)
    try:
        ds = Faces()
        samples = [ds[i] for i in range(5)]
        meta = slots.write(0, samples)
        assert meta is not None and meta[0][1] == (5, 24, 20, 3)
        back = slots.read(0, meta)
        np.testing.assert_array_equal(back[0], np.stack([s[0] for s in samples]))
        np.testing.assert_array_equal(back[2], np.arange(5))
        del back
        bigger = Faces(size=(64, 64))  # a larger batch grows the slot
        meta = slots.write(0, [bigger[i] for i in range(5)])
        np.testing.assert_array_equal(slots.read(0, meta)[0], np.stack([bigger[i][0] for i in range(5)]))
    finally:
        slots.close()


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_a_failing_sample_is_a_data_error_after_the_batches_before_it(workers):
    batches = batches_of(40)
    got = []
    with pytest.raises(DataError, match=r"KeyError while loading samples 12\.\.15: 'boom'"):
        for batch in DataLoader(Faces(bad=13), batches, num_workers=workers):
            got.append(batch)
    check_equal(got, oracle(Faces(), batches[:3]))
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("workers", [0, 2])
def test_skipped_samples_are_reported_with_their_batch(workers):
    batches, reports = batches_of(40), []
    loader = DataLoader(Faces(skip=21), batches, num_workers=workers,
                        on_skip=lambda msgs: reports.append((len(got), list(msgs))))
    got = []
    for batch in loader:
        got.append(batch)
    check_equal(got, oracle(Faces(skip=21), batches))
    assert reports == [(5, ["sample 21 is bad"])]  # reported as batch 5 (samples 20..23) arrives


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mid_epoch_start_continues_the_same_order(workers):
    order = list(np.random.default_rng(5).permutation(40))
    batches = batches_of(40, order)
    got = list(DataLoader(Faces(), batches[6:], num_workers=workers))
    check_equal(got, oracle(Faces(), batches)[6:])


def test_a_worker_killed_between_batches_is_noticed_within_a_second():
    batches = batches_of(40)
    got = []
    loader = iter(DataLoader(Faces(), batches, num_workers=2))
    with contextlib.closing(loader):
        got.append(next(loader))
        victim = multiprocessing.active_children()[0]
        os.kill(victim.pid, signal.SIGKILL)
        time.sleep(0.2)  # the worker is dead; its next batches may already be in the slots
        start = time.time()
        with pytest.raises(DataError, match=f"pid {victim.pid} killed by signal 9"):
            next(loader)
        assert time.time() - start < 1.5
    check_equal(got, oracle(Faces(), batches[:1]))
    assert multiprocessing.active_children() == []


def test_workers_leave_a_stop_to_the_main_process():
    """SIGTERM and SIGINT sent to the workers (as a signal to the process group or to every
    process of a job reaches them) kill none of them: every batch arrives, in order."""
    batches = batches_of(40)
    got = []
    loader = iter(DataLoader(Faces(), batches, num_workers=2))
    with contextlib.closing(loader):
        got.append(next(loader))
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGTERM)
            os.kill(child.pid, signal.SIGINT)
        time.sleep(0.3)
        got += list(loader)
    check_equal(got, oracle(Faces(), batches))
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("codes,names,advice", [
    ([-9], "pid 11 killed by signal 9 (SIGKILL)", True),
    ([-15], "pid 11 killed by signal 15 (SIGTERM)", False),
    ([-15, 3], "pid 11 killed by signal 15 (SIGTERM), pid 12 exit status 3", False),
    ([None], "pid 11 closed its result pipe", False)])
def test_a_worker_death_names_how_and_advises_on_memory_for_sigkill_only(codes, names, advice):
    from plsc.data import WorkerDied
    err = WorkerDied([(11 + k, code) for k, code in enumerate(codes)])
    assert isinstance(err, DataError) and str(err).startswith(f"a data loader worker died ({names})")
    assert ("if it ran out of memory, lower Data.num_workers" in str(err)) == advice
    killed = [-c for c in codes if c is not None and c < 0]
    assert err.signals == (tuple(killed) if len(killed) == len(codes) else ())


def test_workers_end_with_the_iterator():
    loader = iter(DataLoader(Faces(), batches_of(40), num_workers=2))
    next(loader)
    assert len(multiprocessing.active_children()) == 2
    loader.close()
    assert multiprocessing.active_children() == []


def test_no_objects_pile_up_over_thousands_of_batches():
    """3,000 batches through 2 workers, each turned into float32 and reduced as a step would:
    the count of Python objects the collector tracks is flat after a warm-up (Paddle 3.3.1's
    paddle.to_tensor leaves a list per call: 2 a batch would add ~5,000)."""
    class Tiny(Faces):
        def __getitem__(self, i):
            return np.full((8, 8, 3), i % 251, np.uint8), i

    counts = []
    batches = [[(4 * b + k) % 64 for k in range(4)] for b in range(3000)]
    for n, (x, y) in enumerate(DataLoader(Tiny(), batches, num_workers=2)):
        assert int(y.numpy()[0]) == batches[n][0]
        float(x.astype("float32").mean())
        if n in (500, 2999):
            gc.collect()
            counts.append(len(gc.get_objects()))
    assert counts[1] - counts[0] < 200, counts


_MID_MESSAGE = """
import os, signal, sys, threading, time
import numpy as np
from plsc.data import DataError, DataLoader
path = sys.argv[1]
os.environ["PLSC_TEST_PAUSE_WRITE_AT"] = f"1:{path}"

class Mixed:  # uint8 and uint16 images in one batch: no slot layout, the batch goes pickled
    def __len__(self):
        return 32
    def __getitem__(self, i):
        return np.full((112, 112, 3), i, np.uint8 if i % 2 else np.uint16), i

def kill():
    while not os.path.exists(path):
        time.sleep(0.01)
    os.kill(int(open(path).read()), signal.SIGKILL)

threading.Thread(target=kill, daemon=True).start()
labels = []
try:
    for x, y in DataLoader.sequential(Mixed(), 8, num_workers=2):
        labels += y.numpy().tolist()
except DataError as err:
    print("error", labels, err)
"""


def test_a_worker_killed_mid_message_is_a_data_error(tmp_path):
    """A batch that cannot use a slot travels pickled (602 KB here, more than a pipe holds):
    its worker killed half-way through the message ends the loop with a DataError, never a
    wait for the rest (the test hook pauses it there)."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _MID_MESSAGE, str(tmp_path / "paused")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "error" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "killed by signal 9" in proc.stdout and "error [0, 1, 2, 3, 4, 5, 6, 7" in proc.stdout


@pytest.mark.parametrize("workers", [0, 2])
def test_reused_tensors_hold_each_batch_until_overwritten(workers):
    """With reuse=3, batch k's tensors hold batch k while the caller holds it and the next
    two (read at each step), and a short last batch is still right."""
    batches = batches_of(37)
    want = oracle(Faces(), batches)
    held = []
    for n, batch in enumerate(DataLoader(Faces(), batches, num_workers=workers, reuse=3)):
        held = (held + [(n, batch)])[-3:]
        check_equal([b for _, b in held], [want[k] for k, _ in held])


# ------------------------------------------------------------------ Prefetcher
def prefetch_threads():
    import threading
    return [t for t in threading.enumerate() if t.name == "plsc-prefetch"]


@pytest.mark.parametrize("workers", [0, 2])
def test_prefetcher_gives_the_same_batches_and_skips_in_the_callers_thread(workers):
    import threading
    from plsc.data import Prefetcher
    batches, reports, got = batches_of(40), [], []
    loader = DataLoader(Faces(skip=21), batches, num_workers=workers, reuse=4,
                        on_skip=lambda msgs: reports.append((len(got), threading.current_thread().name, msgs)))
    with contextlib.closing(iter(Prefetcher(loader))) as it:
        for batch in it:
            got.append(batch)
            check_equal(got[-1:], oracle(Faces(skip=21), batches)[len(got) - 1:len(got)])
    assert reports == [(5, threading.current_thread().name, ["sample 21 is bad"])]
    assert len(got) == 10 and prefetch_threads() == [] and multiprocessing.active_children() == []


@pytest.mark.parametrize("workers", [0, 2])
def test_prefetcher_raises_the_data_error_at_its_batch(workers):
    from plsc.data import Prefetcher
    batches, got = batches_of(40), []
    with pytest.raises(DataError, match=r"KeyError while loading samples 12\.\.15: 'boom'"):
        for batch in Prefetcher(DataLoader(Faces(bad=13), batches, num_workers=workers)):
            got.append(batch)
    check_equal(got, oracle(Faces(), batches[:3]))
    time.sleep(0.2)
    assert prefetch_threads() == [] and multiprocessing.active_children() == []


def test_prefetcher_closed_early_ends_its_thread_and_workers():
    from plsc.data import Prefetcher
    it = iter(Prefetcher(DataLoader(Faces(), batches_of(40), num_workers=2)))
    next(it)
    it.close()
    assert prefetch_threads() == [] and multiprocessing.active_children() == []
