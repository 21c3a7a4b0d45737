"""The buckets of `OverlappedSum` (its sums on real ranks: test_trainer_distributed.py)."""
import paddle
import pytest

from plsc.train.grad_sync import OverlappedSum


def test_buckets_follow_the_backward_and_the_byte_budget():
    """Reverse parameter order (the order the backward completes gradients), each bucket at
    most the budget unless one parameter alone exceeds it; frozen parameters left out."""
    sizes = (10, 300, 50, 50, 400, 5, 2000)
    params = [paddle.create_parameter([n], "float32") for n in sizes]
    params[1].stop_gradient = True
    summed = OverlappedSum(params, bucket_bytes=400 * 4)
    layout = [[p.shape[0] for p in bucket] for bucket in summed.buckets]
    expected, bucket = [], []
    for n in [n for i, n in reversed(list(enumerate(sizes))) if i != 1]:
        if bucket and 4 * (sum(bucket) + n) > 400 * 4:
            expected.append(bucket)
            bucket = []
        bucket.append(n)
    expected.append(bucket)
    assert layout == expected == [[2000], [5], [400], [50, 50, 10]]
    summed.arm()
    extra = paddle.ones([1])
    assert summed.finish(extra=extra) is extra  # one process: nothing to sum


def test_an_all_reduce_failing_in_the_backward_is_raised_by_finish(monkeypatch):
    """Paddle's backward turns an exception in a hook into a SystemError without its message;
    a lost rank's error (which the trainer reports as RankLost) must reach `finish` intact."""
    from plsc.train import grad_sync
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:576] Read error [127.0.0.1]:30631: "
                        "Connection reset by peer")

    def fail(*args, **kwargs):
        raise lost
    monkeypatch.setattr(grad_sync.pd, "group_rank_size", lambda group=None: (0, 2))
    monkeypatch.setattr(grad_sync, "_reduce_flat", fail)
    layer = paddle.nn.Linear(3, 2)
    summed = OverlappedSum(layer.parameters())
    summed.arm()
    layer(paddle.rand([4, 3])).sum().backward()  # the hooks' all-reduce fails: kept, not raised
    with pytest.raises(RuntimeError) as info:
        summed.finish()
    assert info.value is lost
