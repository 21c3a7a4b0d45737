"""The one partition of classes across ranks (`paddle.shard_index` semantics)."""
import paddle

__all__ = ["ClassPartition"]


class ClassPartition:
    """Contiguous split of `num_classes` into `world_size` shards of `ceil(C/k)`.

    Rank r owns classes `[r*shard, min((r+1)*shard, C))`. Every rank must own
    at least one class; a split that leaves one empty is a configuration error.
    """

    def __init__(self, num_classes, world_size):
        num_classes, world_size = int(num_classes), int(world_size)
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.num_classes = num_classes
        self.world_size = world_size
        self.shard_size = -(-num_classes // world_size)
        last = self.num_local(world_size - 1, check=False)
        if last < 1:
            used = -(-num_classes // self.shard_size)
            raise ValueError(
                f"cannot split {num_classes} classes over {world_size} ranks: with shards of "
                f"ceil({num_classes}/{world_size}) = {self.shard_size} classes only {used} ranks "
                f"get any; use at most {used} ranks or more classes")

    def class_start(self, rank):
        self._check_rank(rank)
        return rank * self.shard_size

    def num_local(self, rank, check=True):
        if check:
            self._check_rank(rank)
        start = rank * self.shard_size
        return max(0, min(start + self.shard_size, self.num_classes) - start)

    def owner(self, label):
        """Rank that owns class `label`."""
        label = int(label)
        if not 0 <= label < self.num_classes:
            raise ValueError(f"label {label} is outside [0, {self.num_classes})")
        return label // self.shard_size

    def shard_labels(self, labels, rank):
        """Global labels -> indices local to `rank`, -1 where another rank owns them."""
        self._check_rank(rank)
        labels = paddle.reshape(labels.astype("int64"), [-1, 1])
        local = paddle.shard_index(labels, index_num=self.num_classes, nshards=self.world_size,
                                   shard_id=rank, ignore_value=-1)
        return local.reshape([-1])

    def _check_rank(self, rank):
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")

    def __repr__(self):
        return (f"ClassPartition(num_classes={self.num_classes}, world_size={self.world_size}, "
                f"shard_size={self.shard_size})")
