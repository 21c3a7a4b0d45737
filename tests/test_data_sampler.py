"""Distributed batch sampler: disjoint equal shares of a seeded per-epoch permutation."""
import numpy as np
import paddle
import pytest

from plsc.data import DistributedBatchSampler


def batches(size, world, batch, epoch=0, seed=0, drop_last=True):
    out = []
    for r in range(world):
        s = DistributedBatchSampler(size, batch, rank=r, world_size=world, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        out.append(list(s))
        assert len(out[-1]) == len(s)
    return out


def test_ranks_get_disjoint_equal_batches():
    per_rank = batches(103, 4, 5)
    assert all(len(b) == 5 for r in per_rank for b in r)
    assert len({len(r) for r in per_rank}) == 1 and len(per_rank[0]) == 25 // 5
    flat = [i for r in per_rank for b in r for i in b]
    assert len(flat) == len(set(flat)) == 100 and set(flat) <= set(range(103))


def test_without_drop_last_the_short_batch_is_equal_on_every_rank():
    per_rank = batches(50, 3, 4, drop_last=False)  # 16 per rank: 4 batches of 4; 17 would be 4 + 1
    assert [len(r) for r in per_rank] == [4, 4, 4]
    per_rank = batches(53, 3, 4, drop_last=False)  # 17 per rank
    assert [[len(b) for b in r] for r in per_rank] == [[4, 4, 4, 4, 1]] * 3


def test_epochs_are_seeded_and_differ():
    assert batches(64, 2, 8, epoch=1) == batches(64, 2, 8, epoch=1)
    assert batches(64, 2, 8, epoch=1) != batches(64, 2, 8, epoch=2)
    assert batches(64, 2, 8, epoch=1, seed=1) != batches(64, 2, 8, epoch=1, seed=0)
    s = DistributedBatchSampler(16, 4, rank=0, world_size=1, shuffle=False)
    assert list(s) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_defaults_from_paddle_and_bad_arguments():
    s = DistributedBatchSampler(10, 2)
    assert (s.rank, s.world_size) == (0, 1)
    with pytest.raises(ValueError, match="rank"):
        DistributedBatchSampler(10, 2, rank=2, world_size=2)


class _Range(paddle.io.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return np.float32(i), i


def test_works_as_dataloader_batch_sampler():
    s = DistributedBatchSampler(_Range(), 3, rank=1, world_size=2, seed=5)
    loader = paddle.io.DataLoader(_Range(), batch_sampler=s, num_workers=0)
    got = [y.numpy().tolist() for _, y in loader]
    assert got == list(s)


# ------------------------------------------------------------------ block shuffle
def block_oracle(size, world, batch, block, buffer, seed, epoch, rank):
    """A literal transcription of the documented block order (lists, Python's loops)."""
    blocks = [list(range(lo, min(lo + block, size))) for lo in range(0, size, block)]
    perm = np.random.default_rng([seed, epoch]).permutation(len(blocks))
    seq = [i for b in perm for i in blocks[b]]
    per_rank = size // world
    mine = seq[rank * per_rank:(rank + 1) * per_rank]
    out = []
    for w, lo in enumerate(range(0, len(mine), block * buffer)):
        part = np.array(mine[lo:lo + block * buffer])
        out += np.random.default_rng([seed, epoch, rank, w]).permutation(part).tolist()
    return [out[b * batch:(b + 1) * batch] for b in range(len(out) // batch)]


@pytest.mark.parametrize("size,world,block,buffer", [(103, 1, 8, 3), (1000, 3, 10, 4), (77, 2, 100, 2)])
def test_block_shuffle_follows_its_definition(size, world, block, buffer):
    for epoch in (0, 3):
        got = []
        for r in range(world):
            s = DistributedBatchSampler(size, 5, r, world, seed=7, block_size=block, buffer_blocks=buffer)
            s.set_epoch(epoch)
            got.append(list(s))
            assert got[-1] == block_oracle(size, world, 5, block, buffer, 7, epoch, r)
            assert len(got[-1]) == len(s)
        flat = [i for r in got for b in r for i in b]
        assert len(flat) == len(set(flat))  # disjoint across ranks


def test_block_shuffle_reads_runs_of_consecutive_records():
    """Every window of `buffer` blocks touches at most buffer + 1 runs of consecutive indices
    (a window may start and end inside a block), and epochs differ."""
    s = DistributedBatchSampler(4096, 64, 0, 1, seed=0, block_size=32, buffer_blocks=4)
    order = s.indices()
    for lo in range(0, 4096, 128):
        runs = np.unique(order[lo:lo + 128] // 32)
        assert len(runs) <= 5
    s.set_epoch(1)
    assert not np.array_equal(order, s.indices())


def test_block_shuffle_is_resume_exact():
    """A sampler built afresh for the same epoch (a resumed run) gives the same batches, so
    skipping the first k (`FromBatch`, as the trainer does) continues the interrupted order."""
    a = DistributedBatchSampler(500, 8, 1, 2, seed=3, block_size=16, buffer_blocks=3)
    a.set_epoch(2)
    first = list(a)
    b = DistributedBatchSampler(500, 8, 1, 2, seed=3, block_size=16, buffer_blocks=3)
    b.set_epoch(2)
    assert list(b)[5:] == first[5:]
    from plsc.data.sampler import FromBatch
    assert list(FromBatch(b, 5)) == first[5:]
