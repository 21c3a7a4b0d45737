"""The exception types raised for bad data files: `DataError`, and `PeerDataError` on the ranks
that stop because another rank met one."""

__all__ = ["DataError", "PeerDataError"]


class DataError(ValueError):
    """A data file is malformed: the message names the file, the key or
    offset, and what was expected."""


class PeerDataError(DataError):
    """Another rank could not load its data; that rank's own error names the sample."""

    def __init__(self, rank, peer, when):
        self.rank, self.peer = rank, peer
        super().__init__(f"rank {rank}: rank {peer} stopped on a data error {when} (its log names "
                         "the file or record); exiting")
