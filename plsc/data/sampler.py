"""Distributed batch sampler: each rank takes its own slice of a seeded per-epoch permutation."""
import numpy as np

__all__ = ["DistributedBatchSampler", "FromBatch"]


class DistributedBatchSampler:
    """Batches of indices into a dataset of `size` samples (or ``len(dataset)``).

    Epoch `e` permutes all indices with a generator seeded by ``(seed, e)``
    (identity order when not `shuffle`); rank `r` of `world_size` takes the
    `r`-th of `world_size` equal slices (the last ``size % world_size``
    indices of the permutation go unused that epoch). With `drop_last` a
    short final batch is dropped, so every rank yields the same number of
    batches of exactly `batch_size`; without it the final batch may be short,
    but equally so on every rank. Call `set_epoch` before each epoch.
    `rank` and `world_size` default to ``paddle.distributed``'s.

    Block shuffle (`block_size` > 0, for a ``.rec`` on a slow disk): the indices are cut into
    blocks of `block_size` consecutive samples (a ``.rec`` is written identity by identity, so a
    block is one or a few identities); the epoch's permutation (seeded by ``(seed, e)``, the
    same on every rank) orders the blocks, and rank `r` takes the `r`-th equal slice of that
    sequence -- runs of whole blocks, a block cut at most at each end. Each rank then shuffles
    its slice within windows of `buffer_blocks` blocks (seeded by ``(seed, e, rank, window)``),
    so its reads stay within `buffer_blocks` runs of consecutive records at a time. Either
    order is a function of (seed, epoch, rank) alone: a run resumed mid-epoch continues it.
    """

    def __init__(self, dataset, batch_size, rank=None, world_size=None, shuffle=True, seed=0, drop_last=True,
                 block_size=0, buffer_blocks=64):
        if rank is None or world_size is None:
            import paddle.distributed as dist

            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.size = dataset if isinstance(dataset, int) else len(dataset)
        self.batch_size, self.rank, self.world_size = int(batch_size), int(rank), int(world_size)
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        if block_size < 0 or buffer_blocks < 1:
            raise ValueError(f"block_size must be >= 0 and buffer_blocks >= 1, got {block_size}, {buffer_blocks}")
        self.block_size, self.buffer_blocks = int(block_size), int(buffer_blocks)
        self.epoch = 0

    def set_epoch(self, epoch):
        """Use epoch `epoch`'s permutation (seeded by `(seed, epoch)`) from now on."""
        self.epoch = int(epoch)

    @property
    def per_rank(self):
        """Samples each rank reads per epoch (before dropping a short batch)."""
        return self.size // self.world_size

    def __len__(self):
        full, rest = divmod(self.per_rank, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def indices(self):
        """This rank's indices for the current epoch, in order."""
        if self.shuffle and self.block_size:
            return self._block_indices()
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.size) if self.shuffle
                 else np.arange(self.size))
        return order[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]

    def _block_indices(self):
        blocks = -(-self.size // self.block_size)
        order = np.random.default_rng([self.seed, self.epoch]).permutation(blocks)
        starts = order * self.block_size
        runs = [np.arange(a, min(a + self.block_size, self.size)) for a in starts]
        mine = np.concatenate(runs)[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]
        window = self.block_size * self.buffer_blocks
        for w, lo in enumerate(range(0, len(mine), window)):
            rng = np.random.default_rng([self.seed, self.epoch, self.rank, w])
            mine[lo:lo + window] = rng.permutation(mine[lo:lo + window])
        return mine

    def __iter__(self):
        mine = self.indices().tolist()
        for b in range(len(self)):
            yield mine[b * self.batch_size:(b + 1) * self.batch_size]


class FromBatch:
    """A batch sampler that starts its epoch at batch `start` (resume mid-epoch)."""

    def __init__(self, sampler, start=0):
        self.sampler, self.start = sampler, start

    def __len__(self):
        return len(self.sampler) - self.start

    def __iter__(self):
        for i, batch in enumerate(self.sampler):
            if i >= self.start:
                yield batch
