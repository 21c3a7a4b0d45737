"""Distributed batch sampler: each rank takes its own slice of a seeded per-epoch permutation."""
import numpy as np

__all__ = ["DistributedBatchSampler"]


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
    """

    def __init__(self, dataset, batch_size, rank=None, world_size=None, shuffle=True, seed=0, drop_last=True):
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
        self.epoch = 0

    def set_epoch(self, epoch):
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
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.size) if self.shuffle
                 else np.arange(self.size))
        return order[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]

    def __iter__(self):
        mine = self.indices().tolist()
        for b in range(len(self)):
            yield mine[b * self.batch_size:(b + 1) * self.batch_size]
