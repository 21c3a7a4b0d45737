"""plsc.process.ending: how a tool's process ends. A rank of a job of several runs Python's exit
handlers, flushes its output and leaves with os._exit (no finalisation, no C++ static
destructors: Paddle 3.3's store server aborted during them, see the module); any other process
exits the usual way. Here in a child process, with `paddle.distributed` stood in by a module
that reports a group of `world` ranks; tests/test_grad_sync.py checks the real group of two."""
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, types
    world = int(sys.argv[1])
    if world:
        fake = types.ModuleType("paddle.distributed")
        fake.is_initialized = lambda: True
        fake.get_world_size = lambda: world
        sys.modules["paddle.distributed"] = fake

    class Finalised:
        def __del__(self):
            os.write(2, b"finalised\\n")

    kept = Finalised()
    atexit.register(lambda: os.write(2, b"atexit\\n"))
    sys.stdout.write("unflushed output")  # a pipe: block-buffered, still in Python's buffer
    from plsc.process import ending
    print(ending.is_rank_of_several(), file=sys.stderr, flush=True)
    ending.end(int(sys.argv[2]) if sys.argv[2] != "None" else None)
    os.write(2, b"after end\\n")
""")


def run(world, status):
    return subprocess.run([sys.executable, "-c", SCRIPT, str(world), str(status)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("world,status", [(2, 0), (4, 75), (2, None)])
def test_a_rank_of_several_runs_exit_handlers_flushes_and_skips_finalisation(world, status):
    done = run(world, status)
    assert done.returncode == (status or 0), done.stderr
    assert done.stdout == "unflushed output"
    lines = done.stderr.split()
    assert lines == ["True", "atexit"], done.stderr  # no "finalised", nothing after `end`


@pytest.mark.parametrize("world", [0, 1])
def test_any_other_process_exits_the_usual_way(world):
    done = run(world, 3)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "unflushed output"
    assert done.stderr.split() == ["False", "atexit", "finalised"], done.stderr
