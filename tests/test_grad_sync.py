"""The buckets of `OverlappedSum` (its sums on real ranks: test_engine_distributed.py)."""
import paddle

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
