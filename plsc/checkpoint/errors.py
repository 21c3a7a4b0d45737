"""What goes wrong with checkpoints, as one-line errors."""
import json

from ..data.errors import DataError
from ..process.exits import IO_ERROR_EXIT_CODE

__all__ = ["CheckpointDamaged", "CheckpointSaveError", "IO_ERROR_EXIT_CODE", "read_json"]


class CheckpointDamaged(DataError):
    """A checkpoint file is missing, cut short or corrupted; the message names it."""

    def __init__(self, file, reason):
        self.file, self.reason = file, reason
        super().__init__(f"damaged checkpoint file {file}: {reason}")


class CheckpointSaveError(Exception):
    """A checkpoint could not be written (disk full, I/O error, permission): one line."""


def read_json(file):
    """The JSON object in checkpoint file `file`; `CheckpointDamaged` when it does not parse."""
    try:
        with open(file, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointDamaged(file, f"not valid JSON ({err})") from None
