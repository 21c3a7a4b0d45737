"""The one exception type raised for bad data files."""


class DataError(ValueError):
    """A data file is malformed: the message names the file, the key or
    offset, and what was expected."""
