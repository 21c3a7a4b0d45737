"""Sub-centres in the collective softmax (sub-center ArcFace: K centres per class, class-major
rows): a block's GEMM gives the `[N, K·width]` cosines of its centres; `_class_max` reduces
them to the class logits and remembers the winning centre, `_to_centres` sends each class's
gradient back to it. With one centre per class both return their input.
"""
import paddle

from .softmax_blocks import _give_back, _lend, put_along_


def _class_max(step, block, cos):
    """Sub-centres: each class's logit is the largest of its K centres' (`cos`: `[N, K·width]`,
    class-major); `block.pick` keeps which centre (the first of equal ones) for the backward.
    With one centre per class, `cos` itself."""
    k = step.sub_centers
    if k == 1:
        return cos
    per_class = cos.reshape([step.n, block.stop - block.start, k])
    block.pick = paddle.argmax(per_class, axis=2, keepdim=True, dtype="int32")
    out = paddle.take_along_axis(per_class, block.pick, 2, broadcast=False).squeeze(2)
    _give_back(step, block.centre_buffer)
    return out


def _to_centres(step, block, buf):
    """The gradient `buf` of the class logits as that of the centres' (`[N, K·width]`): each
    class's entry goes to the centre that won the max, zero to the others."""
    if step.sub_centers == 1:
        return buf
    width, k = block.stop - block.start, step.sub_centers
    out = _lend(step, block.centre_buffer, [step.n, width * k])
    out = paddle.zeros([step.n, width * k], "float32") if out is None else out.zero_()
    put_along_(out.reshape([step.n, width, k]), block.pick.astype("int64"), buf.unsqueeze(2), 2)
    block.pick = None
    return out
