"""BatchNorm running statistics (`plsc.models.batchnorm`) against torch's update written in
numpy float64: running = 0.9·running + 0.1·batch statistic (torch's momentum 0.1, running
mean 0 and variance 1 at the start: torch's values, not read from the layers), the variance
taken unbiased (n/(n-1), n values per channel) or, with `unbiased_var` off, biased (Paddle's).

Tolerance: the running variance is a float32 value rounded at each of 3 updates (2^-24
relative each) plus 0.1 times a batch variance that Paddle sums in float32 (a few roundings
relative to it); `TOL` = 1e-6 relative (16·2^-24; the errors measured are 1-3e-7) allows that.
Each check also asserts that the n/(n-1) factor moves the variance by more than 10·TOL in some
channel of the layer, so the biased update cannot pass for the unbiased one (in every layer of
a test on layers; in most of a backbone's, see there)."""
import numpy as np
import paddle
import pytest

from plsc.parts import build_backbone
from plsc.config import ConfigError, validate
from plsc.models import blocked, build_model
from plsc.models.batchnorm import BatchNorm1D, BatchNorm2D

TORCH_MOMENTUM = 0.1  # torch's BatchNorm default, arcface_torch's every BatchNorm
TOL = 1e-6


def torch_update(inputs, unbiased=True):
    """(running mean, running var) after torch's updates with `inputs` ([N, C, ...] arrays, one
    a step), in float64."""
    mean, var = 0.0, 1.0
    for x in inputs:
        x = np.moveaxis(np.asarray(x, np.float64), 1, 0).reshape(x.shape[1], -1)
        mean = (1 - TORCH_MOMENTUM) * mean + TORCH_MOMENTUM * x.mean(axis=1)
        var = (1 - TORCH_MOMENTUM) * var + TORCH_MOMENTUM * x.var(axis=1, ddof=int(unbiased))
    return mean, var


def _plain(x):
    """A layer's input as a plain numpy array (a blocked activation, `plsc.models.blocked`,
    as the [N, C, H, W] it holds)."""
    return (blocked.to_plain(x) if blocked.is_blocked(x) else x).numpy()


def check_statistics(name, layer, inputs, unbiased=True):
    """`layer`'s running statistics against `torch_update(inputs)`; returns whether the other
    variance (biased for unbiased) would have failed the check."""
    mean, var = torch_update(inputs, unbiased)
    other = torch_update(inputs, not unbiased)[1]
    got_mean, got_var = layer._mean.numpy().astype(np.float64), layer._variance.numpy()
    assert np.all(np.abs(got_var - var) <= TOL * np.abs(var)), \
        f"{name}: variance off by {np.max(np.abs(got_var - var) / np.abs(var)):.2e} relative"
    assert np.all(np.abs(got_mean - mean) <= TOL * (np.abs(mean) + np.sqrt(var))), name
    return bool(np.any(np.abs(var - other) > 10 * TOL * np.abs(var)))


@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("shape", [(4, 3, 3, 3), (8, 5), (4, 5, 3)], ids=["2d", "1d", "1d-ncl"])
def test_a_layer_follows_torch_update_over_steps(shape, unbiased):
    """Three training steps on different batches, then one in eval mode that changes nothing;
    the output is Paddle's own BatchNorm's (the normalisation uses the biased variance in
    torch too)."""
    rng = np.random.RandomState(len(shape))
    layer = (BatchNorm2D if len(shape) == 4 else BatchNorm1D)(shape[1], momentum=0.9)
    reference = (paddle.nn.BatchNorm2D if len(shape) == 4 else paddle.nn.BatchNorm1D)(shape[1])
    layer.unbiased_var = unbiased
    inputs = [(rng.normal(size=shape) * rng.uniform(0.5, 4, size=(1, shape[1]) + (1,) *
                                                     (len(shape) - 2)) + 3.0).astype(np.float32)
              for _ in range(3)]
    for x in inputs:
        out = layer(paddle.to_tensor(x))
        assert np.array_equal(out.numpy(), reference(paddle.to_tensor(x)).numpy())
    assert check_statistics(str(shape), layer, inputs, unbiased)
    layer.eval()
    layer(paddle.to_tensor(inputs[0]))
    assert check_statistics(str(shape), layer, inputs, unbiased)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("name", ["IResNetTiny", "MobileFaceNet", "ViTDemo"])
def test_every_batchnorm_of_a_backbone_follows_torch(name):
    """Every BatchNorm of a backbone in training, three forwards: its inputs (seen by a
    pre-hook) give the oracle. In most layers, the last (the embedding's) among them, the
    n/(n-1) factor is visible; MobileFaceNet's depthwise layers see batch variances so small
    next to the running variance's start at 1 that it is not."""
    paddle.seed(0)
    model = build_model(name, embedding_size=16, input_size=(16, 16))
    model.train()
    norms = [(n, m) for n, m in model.named_sublayers()
             if isinstance(m, paddle.nn.layer.norm._BatchNormBase)]
    assert norms and all(isinstance(m, (BatchNorm1D, BatchNorm2D)) for _, m in norms)
    seen = {n: [] for n, _ in norms}
    for n, m in norms:
        m.register_forward_pre_hook(lambda layer, args, n=n: seen[n].append(_plain(args[0])))
    rng = np.random.RandomState(1)
    with paddle.no_grad():
        for _ in range(3):
            model(paddle.to_tensor(rng.normal(size=(3, 3, 16, 16)).astype(np.float32)))
    told = []
    for n, m in norms:
        assert len(seen[n]) == 3, n
        told.append(check_statistics(f"{name}.{n}", m, seen[n]))
    assert told[-1] and sum(told) >= 0.6 * len(told), f"{sum(told)} of {len(told)} told apart"


def test_the_config_option_reaches_every_batchnorm():
    raw = {"Loss": {"num_classes": 4}, "Data": {"root": "x", "image_size": [16, 16]},
           "Model": {"name": "IResNetTiny", "embedding_size": 16}}
    assert all(m.unbiased_var for m in build_backbone(validate(raw)).sublayers()
               if isinstance(m, (BatchNorm1D, BatchNorm2D)))
    raw["Model"]["bn_unbiased_var"] = False
    norms = [m for m in build_backbone(validate(raw)).sublayers()
             if isinstance(m, (BatchNorm1D, BatchNorm2D))]
    assert len(norms) > 5 and not any(m.unbiased_var for m in norms)
    raw["Model"]["bn_unbiased_var"] = "sometimes"
    with pytest.raises(ConfigError, match="bn_unbiased_var"):
        validate(raw)
