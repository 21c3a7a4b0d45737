"""Backbones: parameter counts, shapes, numerics, init, registry and export.

Oracles:
- TORCH_REFERENCE_COUNTS: built at development time (not here) from insightface's
  arcface_torch backbones (deepinsight/insightface, recognition/arcface_torch/
  backbones/iresnet.py and mobilefacenet.py, transcribed into torch 2.13 CPU,
  fp16 removed) as `sum(p.numel() for p in model.parameters())` at 112x112,
  num_features=512 (plus one case at 56x56 / 128-d with the GDC kernel set to 4).
  The count includes the frozen BatchNorm1d scale (requires_grad=False).
- `iresnet_count_by_formula`: an arithmetic count from the architecture
  description, itself checked against the torch figures.
- tests/_models_numpy_ref.py: float64 numpy forward passes written from the
  architecture description.
"""
import numpy as np
import paddle
import pytest

from _models_numpy_ref import iresnet_forward, mobilefacenet_forward
from plsc.models import (ALIASES, MODELS, IResNet, MobileFaceNet, build_model, count_parameters,
                         resolve_name)

TORCH_REFERENCE_COUNTS = {
    "IResNet18": 24025600,
    "IResNet34": 34139328,
    "IResNet50": 43590848,
    "IResNet100": 65156160,
    "IResNet200": 118833920,
    "MobileFaceNet": 2059520,
    "MobileFaceNetLarge": 6314880,
}
TORCH_MBF_56PX_128D = 1845248  # mbf, num_features=128, GDC kernel 4x4 (56 -> 28 -> 14 -> 7 -> 4)

STAGES = {"IResNet18": (2, 2, 2, 2), "IResNet34": (3, 4, 6, 3), "IResNet50": (3, 4, 14, 3),
          "IResNet100": (3, 13, 30, 3), "IResNet200": (6, 26, 60, 6)}
WIDTHS = (64, 128, 256, 512)


def iresnet_count_by_formula(layers, widths, embedding_size, feature_map):
    """Weights of an IResNet counted from its description (BN = scale + shift)."""
    stem = widths[0]
    total = 3 * stem * 9 + 2 * stem + stem                  # conv3x3, BN, PReLU
    in_c = stem
    for num_blocks, c in zip(layers, widths):
        for b in range(num_blocks):
            total += 2 * in_c + in_c * c * 9 + 2 * c + c      # BN, conv3x3, BN, PReLU
            total += c * c * 9 + 2 * c                        # conv3x3, BN
            if b == 0:                                        # stride 2: conv1x1 + BN shortcut
                total += in_c * c + 2 * c
            in_c = c
    total += 2 * in_c                                         # final BN2d
    total += in_c * feature_map[0] * feature_map[1] * embedding_size + embedding_size  # fc
    return total + 2 * embedding_size                         # BatchNorm1d on the features


@pytest.fixture(autouse=True)
def _seed():
    paddle.seed(0)


def _randomise_batch_norms(model, seed=0):
    """Non-trivial BN statistics/affines and PReLU slopes, so a misplaced layer shows."""
    rng = np.random.RandomState(seed)
    for name, param in model.state_dict().items():
        shape = param.shape
        if name.endswith("._mean") or name.endswith(".bias") and len(shape) == 1:
            value = rng.normal(0.0, 0.2, shape)
        elif name.endswith("._variance"):
            value = rng.uniform(0.5, 2.0, shape)
        elif name.endswith("._weight"):
            value = rng.uniform(0.05, 0.5, shape)
        elif name.endswith(".weight") and len(shape) == 1 and not param.stop_gradient:
            value = rng.uniform(0.5, 1.5, shape)
        else:
            continue
        param.set_value(value.astype("float32"))


# ---------------------------------------------------------------- parameter counts

def test_formula_matches_torch_reference():
    for name, layers in STAGES.items():
        assert iresnet_count_by_formula(layers, WIDTHS, 512, (7, 7)) == TORCH_REFERENCE_COUNTS[name]


@pytest.mark.parametrize("name", list(TORCH_REFERENCE_COUNTS))
def test_parameter_count_at_112px_512d(name):
    model = build_model(name)
    assert model.num_parameters() == TORCH_REFERENCE_COUNTS[name]
    frozen = 512 if name.startswith("IResNet") else 0  # the features BN scale
    assert model.num_parameters(trainable_only=True) == TORCH_REFERENCE_COUNTS[name] - frozen


def test_mobilefacenet_count_follows_input_size():
    model = build_model("mbf", input_size=56, embedding_size=128)
    assert model.num_parameters() == TORCH_MBF_56PX_128D


@pytest.mark.parametrize("input_size,feature_map", [((56, 56), (4, 4)), ((64, 48), (4, 3)),
                                                    ((120, 120), (8, 8)), ((32, 32), (2, 2))])
def test_iresnet_count_follows_input_and_widths(input_size, feature_map):
    model = build_model("IResNet18", input_size=input_size, embedding_size=256)
    assert model.num_parameters() == iresnet_count_by_formula(STAGES["IResNet18"], WIDTHS, 256, feature_map)
    tiny = build_model("IResNetTiny", input_size=input_size, embedding_size=64)
    assert tiny.num_parameters() == iresnet_count_by_formula((1, 1, 1, 1), (16, 32, 64, 128), 64, feature_map)


def test_count_parameters_skips_running_statistics():
    # BatchNorm2D(8): 8 scales + 8 shifts; the 16 running statistics are state.
    assert count_parameters(paddle.nn.BatchNorm2D(8)) == 16
    assert len(paddle.nn.BatchNorm2D(8).parameters()) == 4  # why the helper is needed


# ---------------------------------------------------------------- shapes

@pytest.mark.parametrize("name,input_size,embedding_size,fc_in", [
    ("IResNetTiny", (32, 32), 512, 128 * 2 * 2),
    ("IResNetTiny", (56, 56), 128, 128 * 4 * 4),
    ("IResNetTiny", (40, 24), 64, 128 * 3 * 2),
    ("IResNet18", (32, 32), 256, 512 * 2 * 2),
])
def test_iresnet_output_shape(name, input_size, embedding_size, fc_in):
    model = build_model(name, input_size=input_size, embedding_size=embedding_size)
    assert list(model.fc.weight.shape) == [fc_in, embedding_size]
    x = paddle.randn([2, 3, *input_size])
    assert list(model(x).shape) == [2, embedding_size]
    model.eval()
    assert list(model(x[:1]).shape) == [1, embedding_size]


@pytest.mark.parametrize("input_size,embedding_size,kernel", [((32, 32), 512, [2, 2]),
                                                              ((48, 64), 128, [3, 4])])
def test_mobilefacenet_output_shape(input_size, embedding_size, kernel):
    model = build_model("MobileFaceNet", input_size=input_size, embedding_size=embedding_size)
    assert list(model.features.dw.weight.shape[2:]) == kernel
    assert list(model(paddle.randn([2, 3, *input_size])).shape) == [2, embedding_size]


def test_wrong_input_size_is_rejected():
    model = build_model("IResNetTiny", input_size=32)
    with pytest.raises(Exception):
        model(paddle.randn([2, 3, 64, 64]))


# ---------------------------------------------------------------- numerics vs numpy

@pytest.mark.parametrize("name,arch,seed,shape,reference", [
    ("IResNetTiny", {"layers": (2, 1, 1, 2), "input_size": (40, 24)}, 1, (3, 3, 40, 24), iresnet_forward),
    ("MobileFaceNet", {"blocks": (1, 2, 1, 1), "input_size": 32}, 2, (2, 3, 32, 32), mobilefacenet_forward),
], ids=["iresnet", "mobilefacenet"])
def test_matches_numpy_reference(name, arch, seed, shape, reference):
    model = build_model(name, embedding_size=32, **arch)
    _randomise_batch_norms(model)
    model.eval()
    x = np.random.RandomState(seed).normal(0, 1, shape).astype("float32")
    got = model(paddle.to_tensor(x)).numpy()
    want = reference(model, x.astype("float64"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# ---------------------------------------------------------------- init, frozen BN, dropout

def test_iresnet_initialisation_follows_insightface():
    model = build_model("IResNet18")
    conv = model.layer4[1].conv2.weight.numpy()            # 2.4M draws from N(0, 0.1^2)
    assert abs(conv.std() - 0.1) < 1e-3 and abs(conv.mean()) < 1e-3
    fc = model.fc.weight.numpy()                           # U(+-1/sqrt(512*7*7))
    bound = 1 / np.sqrt(512 * 49)
    assert np.abs(fc).max() <= bound * (1 + 1e-6) and np.abs(fc).max() > 0.99 * bound
    bn = model.layer2[0].bn1
    assert np.all(bn.weight.numpy() == 1) and np.all(bn.bias.numpy() == 0)


def test_mobilefacenet_initialisation_is_he_normal_fan_out():
    model = build_model("MobileFaceNet")
    sep = model.conv_sep[0].weight.numpy()                 # [512, 256, 1, 1], fan_out 512
    assert abs(sep.std() / np.sqrt(2 / 512) - 1) < 0.02
    linear = model.features.linear.weight.numpy()          # fan_out = embedding size
    assert abs(linear.std() / np.sqrt(2 / 512) - 1) < 0.02


def test_embedding_bn_scale_is_frozen_at_one():
    model = build_model("IResNetTiny", input_size=32, embedding_size=16)
    model(paddle.randn([4, 3, 32, 32])).sum().backward()
    assert np.all(model.features.weight.numpy() == 1.0)
    assert model.features.weight.stop_gradient and model.features.weight.grad is None
    assert model.fc.weight.grad is not None
    np.testing.assert_allclose(model.features.bias.grad.numpy(), 4.0)  # d(sum y)/d shift = batch


def test_dropout_is_applied_in_training_only():
    model = build_model("IResNetTiny", input_size=32, embedding_size=16, dropout=0.5)
    model.eval()  # BN in eval so only dropout can make two passes differ
    x = paddle.randn([2, 3, 32, 32])
    np.testing.assert_array_equal(model(x).numpy(), model(x).numpy())
    model.dropout.train()
    assert not np.allclose(model(x).numpy(), model(x).numpy())
    with pytest.raises(ValueError, match="dropout"):
        build_model("MobileFaceNet", dropout=0.1)


# ---------------------------------------------------------------- registry

def test_registry_names_and_aliases():
    assert set(MODELS) >= {"IResNet18", "IResNet34", "IResNet50", "IResNet100", "IResNet200",
                           "MobileFaceNet", "IResNetTiny"}
    assert all(callable(build) for build in MODELS.values())
    cases = {"iresnet50": "IResNet50", "IRESNET18": "IResNet18", "r50": "IResNet50",
             "R100": "IResNet100", "r200": "IResNet200", "mbf": "MobileFaceNet",
             "mobilefacenet": "MobileFaceNet", "iresnettiny": "IResNetTiny",
             "mbf_large": "MobileFaceNetLarge"}
    for given, canonical in cases.items():
        assert resolve_name(given) == canonical
    assert set(ALIASES.values()) <= set(MODELS)


def test_build_model_passes_arguments():
    tiny = build_model("iresnettiny", input_size=32, embedding_size=8)
    assert isinstance(tiny, IResNet) and tiny.layers_per_stage == (1, 1, 1, 1)
    assert tiny.widths == (16, 32, 64, 128) and tiny.embedding_size == 8
    r34 = build_model("r34", input_size=32)
    assert r34.layers_per_stage == (3, 4, 6, 3)
    large = build_model("mbf_large", input_size=32)
    assert isinstance(large, MobileFaceNet) and large.blocks == (2, 8, 12, 4) and large.scale == 4


@pytest.mark.parametrize("bad,suggestion", [("IResNet500", "IResNet50"),
                                            ("MobileFaceNt", "MobileFaceNet"),
                                            ("iresnet_tiny", "IResNetTiny")])
def test_unknown_name_is_named_with_closest_suggestion(bad, suggestion):
    with pytest.raises(ValueError) as info:
        build_model(bad)
    message = str(info.value)
    assert repr(bad) in message and f"did you mean {suggestion!r}" in message


# ---------------------------------------------------------------- export

@pytest.mark.parametrize("name", ["IResNetTiny", "MobileFaceNet"])
def test_to_static_export_and_reload(name, tmp_path):
    model = build_model(name, input_size=32, embedding_size=64)
    model.eval()
    spec = [paddle.static.InputSpec([None, 3, 32, 32], "float32")]
    path = str(tmp_path / name)
    paddle.jit.save(paddle.jit.to_static(model, input_spec=spec, full_graph=True), path)
    loaded = paddle.jit.load(path)
    loaded.eval()
    for batch in (1, 3):  # dynamic batch dimension
        x = paddle.randn([batch, 3, 32, 32])
        np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
