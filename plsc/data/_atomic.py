"""Write a file under a temporary name and rename it into place on success."""
import contextlib
import os


class TempName:
    """A temporary path beside `path`; `commit()` renames it, `discard()` deletes it."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.tmp = f"{self.path}.tmp-{os.getpid()}"

    def commit(self):
        os.replace(self.tmp, self.path)

    def discard(self):
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.tmp)


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path; it becomes `path` if the block succeeds and is
    deleted if the block raises."""
    name = TempName(path)
    try:
        yield name.tmp
    except BaseException:
        name.discard()
        raise
    name.commit()
