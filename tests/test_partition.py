"""The class partition against a literal ceil split and paddle.shard_index's definition."""
import numpy as np
import paddle
import pytest

from plsc.distributed import ClassPartition


@pytest.mark.parametrize("num_classes,world_size", [(1, 1), (10, 3), (23, 4), (100, 4), (7, 7)])
def test_ceil_split_covers_every_class_once(num_classes, world_size):
    part = ClassPartition(num_classes, world_size)
    shard = -(-num_classes // world_size)
    owned = []
    for r in range(world_size):
        start, n = part.class_start(r), part.num_local(r)
        assert start == r * shard and n >= 1
        owned.extend(range(start, start + n))
    assert owned == list(range(num_classes))
    for label in range(num_classes):
        assert part.owner(label) == label // shard


@pytest.mark.parametrize("num_classes,world_size", [(23, 4), (10, 3), (5, 2)])
def test_shard_labels_keeps_owned_and_marks_others(num_classes, world_size):
    part = ClassPartition(num_classes, world_size)
    labels = np.random.RandomState(0).randint(0, num_classes, 50)
    for r in range(world_size):
        got = part.shard_labels(paddle.to_tensor(labels), r).numpy()
        lo, hi = part.class_start(r), part.class_start(r) + part.num_local(r)
        expect = np.where((labels >= lo) & (labels < hi), labels - lo, -1)
        np.testing.assert_array_equal(got, expect)


def test_split_leaving_a_rank_empty_is_an_error():
    # ceil(5/4) = 2 classes per shard: ranks 0-2 hold 2, 2, 1 and rank 3 none.
    with pytest.raises(ValueError, match=r"cannot split 5 classes over 4 ranks.*use at most 3 ranks"):
        ClassPartition(5, 4)
    with pytest.raises(ValueError, match="num_classes must be >= 1"):
        ClassPartition(0, 1)


def test_rank_and_label_range_errors():
    part = ClassPartition(10, 2)
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        part.class_start(2)
    with pytest.raises(ValueError, match=r"label 10 is outside \[0, 10\)"):
        part.owner(10)
