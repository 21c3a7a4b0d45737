"""The backbone's share of a rank: parameters, gradients, optimizer state (from the model's own
parameter shapes, built under `paddle.LazyGuard`, so nothing is allocated), the gradient sum's
buckets (`OverlappedSum`'s own layout), and FLOPs per sample (one forward of a batch of one
with a hook on every convolution, linear layer and attention)."""
import paddle
from paddle import nn

from ...checkpoint.paddle_file import save_transient_bytes
from ...parts import build_backbone
from ..grad_sync import OverlappedSum

__all__ = ["BackboneCost", "backbone_cost", "forward_flops"]


class BackboneCost:
    """Parameter counts, bytes kept between steps and the gradient sum's buckets."""

    def __init__(self, cfg):
        with paddle.LazyGuard():
            model = build_backbone(cfg)
        params = list(model.parameters())
        trainable = [p for p in params if not p.stop_gradient]
        self.params = sum(int(p.size) for p in params)
        self.trainable = sum(int(p.size) for p in trainable)
        self.buffers = sum(int(b.size) * 4 for b in model.buffers() if b is not None)
        self.largest = max((int(p.size) for p in params), default=0)  # elements
        wire = cfg["Optimizer"]["grad_allreduce_dtype"]
        self.buckets = [sum(int(p.size) for p in b)
                        for b in OverlappedSum(trainable, dtype=wire, mode="after").buckets]
        self.wire = wire
        self.optimizer = cfg["Optimizer"]["name"]

    def kept(self):
        """{name: bytes} kept from step to step: float32 parameters (and buffers), their
        gradients (float32, also with AMP: O1 keeps float32 parameters) and the optimizer's
        state (Momentum: a velocity; AdamW: two moments)."""
        states = 1 if self.optimizer == "sgd" else 2
        return {"backbone parameters": 4 * self.params + self.buffers,
                "backbone gradients": 4 * self.trainable,
                "backbone optimizer state": 4 * states * self.trainable}

    def save_transient(self):
        """Bytes a checkpoint save holds beyond the state (rank 0, host memory): the streamed
        writer's copies of the largest float32 tensor (a parameter or an optimizer moment)."""
        return save_transient_bytes(4 * self.largest)

    def gradient_sum(self):
        """Bytes the gradient sum holds at its peak: each bucket's flat float32 copy (and its
        16-bit payload when the wire is 16 bits), all alive until `finish`."""
        per = 4 + (0 if self.wire == "float32" else 2)
        return per * self.trainable


_KNOWN = {}  # (what, the config's values it reads) -> a BackboneCost or FLOPs, built once


def _once(what, cfg, make):
    key = (what, repr(sorted(cfg["Model"].items())), tuple(cfg["Data"]["image_size"]),
           cfg["Optimizer"]["name"], cfg["Optimizer"]["grad_allreduce_dtype"])
    if key not in _KNOWN:
        _KNOWN[key] = make(cfg)
    return _KNOWN[key]


def backbone_cost(cfg):
    """`BackboneCost(cfg)`, built once a backbone (the planner asks again for each change it
    tries)."""
    return _once("cost", cfg, BackboneCost)


def forward_flops(cfg):
    """Multiply-adds x 2 of one sample's forward: convolutions, linear layers and the
    attentions' two batched products (the elementwise work is left out); counted once a
    backbone."""
    return _once("flops", cfg, _count_flops)


def _count_flops(cfg):
    model = build_backbone(cfg)
    model.eval()
    total = [0]
    hooks = []
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, (nn.Conv2D, nn.Linear)) or type(layer).__name__ == "Attention":
            hooks.append(layer.register_forward_post_hook(_counter(total)))
    h, w = cfg["Data"]["image_size"]
    with paddle.no_grad():
        model(paddle.zeros([1, 3, h, w], dtype="float32"))
    for hook in hooks:
        hook.remove()
    return total[0]


def _counter(total):
    def hook(layer, inputs, output):
        if isinstance(layer, nn.Conv2D):
            c_in, kh, kw = layer.weight.shape[1:]
            total[0] += 2 * int(output.size) * c_in * kh * kw
        elif isinstance(layer, nn.Linear):
            total[0] += 2 * int(output.size) * layer.weight.shape[0]
        else:  # attention: q·kᵀ and attn·v, each 2·L·L·D per sample
            b, length, dim = inputs[0].shape
            total[0] += 4 * b * length * length * dim
    return hook
