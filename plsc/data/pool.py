"""A function over items, in order, in forked processes: the data preparation tools' pool.

Not `multiprocessing.Pool`: its workers must die by SIGTERM for it to end. `Pool.terminate`
(what leaving `with pool:` does) drains the task pipe, sentinels included, and keeps the pipe's
lock, then waits for its SIGTERM to end the workers; but a worker here ignores SIGTERM (a stop
belongs to the main process, `ignore_stop_signals`), so the main process waited forever. And a
worker killed in the middle of a task (the out-of-memory killer) leaves that task unanswered
for ever.

Here each worker has a pipe of its own and no lock is shared. Chunks of items go to the workers
in turn, a few in flight each, and the results are read back in the order sent. A worker that
dies is a `WorkerDied` naming how; an exception in the function is raised in the main process;
when the iteration ends early (an error, a stop, the caller stops reading) the workers are
killed at once, and a worker whose main process is gone ends with its pipe.
"""
import collections
import itertools
import multiprocessing
import os
import traceback
from multiprocessing.connection import wait

from .errors import WorkerDied
from .loader import forking, ignore_stop_signals

__all__ = ["in_order"]

_CHUNK = 16  # items a message carries
_IN_FLIGHT = 4  # chunks sent ahead to each worker


def in_order(fn, items, workers=1, advice="--workers"):
    """fn over `items`, in order; in `workers` forked processes when more than one (the same
    results: each item's is computed by the same function alone). `advice`: the option that
    lowers the workers, named when one is killed (out of memory). Items go to the workers a few
    chunks ahead through their pipes: keep them small (file names, not images)."""
    if workers <= 1:
        yield from map(fn, items)
        return
    chunks = _chunks(iter(items))
    procs, ends = _start(fn, workers)
    try:
        turns = collections.deque()  # the worker of each chunk in flight, in the order sent
        for w in itertools.islice(itertools.cycle(range(workers)), workers * _IN_FLIGHT):
            if not _send(ends[w], chunks):
                break
            turns.append(w)
        while turns:
            w = turns.popleft()
            results = _receive(ends[w], procs[w], advice)
            if _send(ends[w], chunks):
                turns.append(w)
            yield from results
        for end in ends:
            end.send(None)
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
            proc.join()
        for end in ends:
            end.close()


def _chunks(items):
    while chunk := list(itertools.islice(items, _CHUNK)):
        yield chunk


def _start(fn, workers):
    context = multiprocessing.get_context("fork")
    procs, ends = [], []
    with forking():  # the workers leave a stop to this process
        for _ in range(workers):
            mine, theirs = context.Pipe()
            inherited = [end.fileno() for end in ends + [mine]]  # the main process's ends
            proc = context.Process(target=_serve, args=(fn, theirs, inherited),
                                   daemon=True)
            proc.start()
            theirs.close()
            procs.append(proc)
            ends.append(mine)
    return procs, ends


def _send(end, chunks):
    chunk = next(chunks, None)
    if chunk is not None:
        end.send(chunk)
    return chunk is not None


def _receive(end, proc, advice):
    """The next chunk's results from `proc`; its exception raised here; its death a WorkerDied."""
    ready = wait([end, proc.sentinel])
    try:
        ok, value = end.recv() if end in ready or end.poll() else (None, None)
    except (EOFError, OSError):  # it died while writing, or with chunks unread
        ok = None
    if ok is None:
        proc.join()
        raise WorkerDied([(proc.pid, proc.exitcode)], what="data preparation worker",
                         lower=advice) from None
    if not ok:
        raise value
    return value


def _serve(fn, end, inherited):
    ignore_stop_signals()
    for fd in inherited:  # the main process's ends: its death ends this pipe (EOF, EPIPE)
        os.close(fd)
    while True:
        try:
            chunk = end.recv()
        except EOFError:  # the main process is gone
            return
        if chunk is None:
            return
        try:
            reply = True, [fn(item) for item in chunk]
        except Exception as err:  # raised again in the main process
            err.add_note(f"in a data preparation worker:\n{traceback.format_exc()}")
            reply = False, err
        try:
            end.send(reply)
        except OSError:  # the main process is gone
            return
        except Exception as err:  # the result or the exception does not pickle
            end.send((False, RuntimeError(f"{type(err).__name__}: {err}")))
