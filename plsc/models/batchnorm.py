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
from paddle.autograd import PyLayer

from . import blocked
from ..kernels import onednn

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
        self._update_running(batch_mean, batch_var, int(x.size) // self._num_features)
        return out

    def _update_running(self, batch_mean, batch_var, n):
        """Fold a batch's mean and biased variance over `n` values a channel into the running
        statistics (the variance made unbiased when `unbiased_var`)."""
        keep = self._momentum  # Paddle's convention: the weight of the running value
        with paddle.no_grad():
            self._mean.copy_(self._mean * keep + batch_mean * (1.0 - keep), False)
            if self.unbiased_var and n > 1:
                batch_var = batch_var * (n / (n - 1))
            self._variance.copy_(self._variance * keep + batch_var * (1.0 - keep), False)


class BatchNorm1D(_UnbiasedRunningVar, nn.BatchNorm1D):
    """`paddle.nn.BatchNorm1D` with torch's running variance (`unbiased_var`)."""


class _BlockedBatchNorm(PyLayer):
    """Training batch norm of a blocked activation on oneDNN; writes the batch's mean and
    biased variance into `mean` and `var`."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, epsilon):
        x = x if x.is_contiguous() else x.contiguous()
        plan = onednn.batchnorm_plan(blocked.logical_shape(x), epsilon)
        y = paddle.empty(x.shape, dtype=x.dtype)
        plan.forward(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(),
                     mean.data_ptr(), var.data_ptr())
        ctx.plan = plan
        ctx.save_for_backward(x, weight, mean, var)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, var = ctx.saved_tensor()
        dy = dy if dy.is_contiguous() else dy.contiguous()
        dx = paddle.empty(x.shape, dtype=x.dtype)
        dw, db = paddle.empty_like(weight), paddle.empty_like(weight)
        ctx.plan.backward(x.data_ptr(), weight.data_ptr(), mean.data_ptr(), var.data_ptr(),
                          dy.data_ptr(), dx.data_ptr(), dw.data_ptr(), db.data_ptr())
        return dx, dw, db


class BatchNorm2D(_UnbiasedRunningVar, nn.BatchNorm2D):
    """`paddle.nn.BatchNorm2D` with torch's running variance (`unbiased_var`), which also
    takes a blocked activation (`plsc.models.blocked`; then oneDNN's kernel in training)."""

    def forward(self, x):
        if not blocked.is_blocked(x):
            return _UnbiasedRunningVar.forward(self, x)  # (no super(): see above)
        batch_stats = self.training and not self._use_global_stats
        if (self.weight is None or self.bias is None or self._data_format != "NCHW"
                or (not batch_stats and paddle.is_grad_enabled())):  # rare: the plain layer
            return blocked.to_blocked(_UnbiasedRunningVar.forward(self, blocked.to_plain(x)))
        if batch_stats:
            batch_mean, batch_var = paddle.empty_like(self._mean), paddle.empty_like(self._mean)
            out = _BlockedBatchNorm.apply(x, self.weight, self.bias, batch_mean, batch_var,
                                          self._epsilon)
            n, _, h, w = blocked.logical_shape(x)
            self._update_running(batch_mean, batch_var, n * h * w)
            return out
        x = x if x.is_contiguous() else x.contiguous()  # evaluation without gradients
        y = paddle.empty(x.shape, dtype=x.dtype)
        onednn.batchnorm_plan(blocked.logical_shape(x), self._epsilon).infer(
            x.data_ptr(), self.weight.data_ptr(), self.bias.data_ptr(), y.data_ptr(),
            self._mean.data_ptr(), self._variance.data_ptr())
        return y


def set_unbiased_var(model, unbiased):
    """Make every BatchNorm of `model` built from this module update its running variance with
    the unbiased (torch, True) or the biased (Paddle, False) batch variance; returns their
    number."""
    layers = [m for m in model.sublayers(include_self=True) if isinstance(m, _UnbiasedRunningVar)]
    for layer in layers:
        layer.unbiased_var = bool(unbiased)
    return len(layers)
