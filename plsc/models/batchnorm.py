"""BatchNorm layers whose running variance follows torch's: the unbiased batch variance.

A training forward of torch's BatchNorm updates `running_var` with the batch variance times
n/(n-1), n the values per channel in the batch (N·H·W for 2-D maps, N for vectors); Paddle's
with the biased batch variance. Both normalise the batch with the biased variance, so the
output and the gradients are the same; only the statistics an evaluation uses differ (by
(1-momentum)·var/(n-1) per update: 0.8 % of each update of the embedding BatchNorm at 128
images per rank). plsc's backbones are arcface_torch's, so their BatchNorms follow torch
(`unbiased_var`, Model.bn_unbiased_var, default true); `unbiased_var=False` is Paddle's
update. For n = 1 there is no unbiased variance: the batch's (0) is used, as Paddle does
(torch raises).
"""
import paddle
import paddle.nn.functional as F
from paddle import nn

__all__ = ["BatchNorm1D", "BatchNorm2D", "set_unbiased_var"]


class _UnbiasedRunningVar:
    """The training forward of a Paddle BatchNorm with torch's running-variance update."""

    unbiased_var = True

    def forward(self, x):
        if not (self.training and self.unbiased_var) or self._use_global_stats:
            return nn.layer.norm._BatchNormBase.forward(self, x)  # Paddle's (no super():
            # paddle.jit.to_static's conversion of it recurses without end)
        self._check_input_dim(x)
        # Paddle's kernel writes running·momentum + batch·(1 - momentum) into these: with
        # momentum 0 they receive the batch's mean and biased variance.
        batch_mean, batch_var = paddle.zeros_like(self._mean), paddle.zeros_like(self._variance)
        out = F.batch_norm(x, batch_mean, batch_var, weight=self.weight, bias=self.bias,
                           training=True, momentum=0.0, epsilon=self._epsilon,
                           data_format=self._data_format)
        n = int(x.size) // self._num_features
        keep = self._momentum  # Paddle's convention: the weight of the running value
        with paddle.no_grad():
            self._mean.copy_(self._mean * keep + batch_mean * (1.0 - keep), False)
            unbiased = batch_var * (n / (n - 1)) if n > 1 else batch_var
            self._variance.copy_(self._variance * keep + unbiased * (1.0 - keep), False)
        return out


class BatchNorm1D(_UnbiasedRunningVar, nn.BatchNorm1D):
    """`paddle.nn.BatchNorm1D` with torch's running variance (`unbiased_var`)."""


class BatchNorm2D(_UnbiasedRunningVar, nn.BatchNorm2D):
    """`paddle.nn.BatchNorm2D` with torch's running variance (`unbiased_var`)."""


def set_unbiased_var(model, unbiased):
    """Make every BatchNorm of `model` built from this module update its running variance with
    the unbiased (torch, True) or the biased (Paddle, False) batch variance; returns their
    number."""
    layers = [m for m in model.sublayers(include_self=True) if isinstance(m, _UnbiasedRunningVar)]
    for layer in layers:
        layer.unbiased_var = bool(unbiased)
    return len(layers)
