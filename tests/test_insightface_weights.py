"""arcface_torch's backbone weights in and out of plsc: `plsc.models.from_insightface` /
`to_insightface`, `tools/convert_weights.py`, Global.pretrained with a .pt file.

Oracles:
- `arcface_table(name)`: the key -> shape table of the state_dict arcface_torch's
  `get_model(name, num_features=E)` has, written out here from its published architecture
  (deepinsight/insightface, recognition/arcface_torch/backbones/{__init__,iresnet,
  mobilefacenet,vit}.py): IResNet stage depths, widths 64..512, the stride-2 first block with a
  conv1x1+BN shortcut, fc over 512 x 7 x 7 (fc_scale); MobileFaceNet's ConvBlock / LinearBlock /
  DepthWise / Residual, each holding its children in a `layers` Sequential, and its GDC head;
  the ViTs' D, depth, 144 tokens (patch 9 at 112), qkv without bias, the feature head. In
  torch's state_dict order (a module's parameters, then its buffers, then its children in the
  order they were assigned). Other input sizes (plsc builds them, arcface_torch does not) follow
  torch's conv output formula; plsc's own IResNetTiny and ViTDemo follow their docstrings.
- `plsc_key(family, torch_key)`: where a torch value must land in plsc, from Paddle's
  conventions (BatchNorm `_mean`/`_variance`, PReLU `_weight`, Linear weight [in, out]) and
  plsc's module names, written here with regular expressions, not with the code under test.
- Values: every element of a table is a distinct float32 (consecutive bit patterns), so a value
  put in the wrong place, transposed or not, fails a bit-for-bit comparison.

A file for every name is checked key by key and shape by shape against the table (the big models
under paddle.LazyGuard: ViT-H has 756M weights); the values go through the whole round trip
(torchfile.save -> from_insightface -> to_insightface -> torchfile.load) for r18, r34, r50, mbf,
mbf_large, vit_t, IResNetTiny and ViTDemo: the conversion code is the same for
every size of a family, only the layout differs, and that is checked for all.
"""
import os
import re
from collections import OrderedDict

import plsc  # noqa: F401  -- before Paddle, for its CPU set-up
import numpy as np
import paddle
import pytest

import scripts
from plsc import torchfile
from plsc import parts as builders
from plsc.config import ConfigError
from plsc.models import build_model, from_insightface, to_insightface
from plsc.models.insightface import insightface_layout, is_torch_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "convert_weights.py")

# arcface_torch's get_model: name -> architecture.
IRESNETS = {"r18": (2, 2, 2, 2), "r34": (3, 4, 6, 3), "r50": (3, 4, 14, 3),
            "r100": (3, 13, 30, 3), "r200": (6, 26, 60, 6)}
MBFS = {"mbf": ((1, 4, 6, 2), 2), "mbf_large": ((2, 8, 12, 4), 4)}  # blocks, scale
VITS = {"vit_t": (256, 12), "vit_t_dp005_mask0": (256, 12), "vit_s": (512, 12),
        "vit_s_dp005_mask_0": (512, 12), "vit_b": (512, 24), "vit_b_dp005_mask_005": (512, 24),
        "vit_l_dp005_mask_005": (768, 24), "vit_h": (1024, 48)}  # D, depth; 8 heads, patch 9
ARCFACE = (112, 112)
# plsc's own small models (their docstrings): IResNetTiny one block per stage, widths 16..128;
# ViTDemo D 128, depth 4, patch 8 (built for 56x56 in the demo).
PLSC_ONLY = {"IResNetTiny": ("iresnet", (1, 1, 1, 1), (16, 32, 64, 128)),
             "ViTDemo": ("vit", 128, 4, 8)}
ALL_NAMES = list(IRESNETS) + list(MBFS) + list(VITS) + list(PLSC_ONLY)


def family(name):
    if name in IRESNETS or name == "IResNetTiny":
        return "iresnet"
    return "mbf" if name in MBFS else "vit"


# ---------------------------------------------------------------- the published tables

def conv_out(n, kernel, stride, padding):
    """torch.nn.Conv2d's output length."""
    return (n + 2 * padding - kernel) // stride + 1


def _bn(t, key, c):
    for name in ("weight", "bias", "running_mean", "running_var"):
        t[f"{key}.{name}"] = (c,)
    t[f"{key}.num_batches_tracked"] = ()


def iresnet_table(layers, embedding, size=ARCFACE, widths=(64, 128, 256, 512)):
    """iresnet.py: conv1 (3x3, stride 1), bn1, prelu; four stages of IBasicBlocks (bn1, conv1,
    bn2, prelu, conv2 (stride 2 in the first block), bn3, downsample = conv1x1 stride 2 + BN in
    the first block); bn2, fc (Linear with bias), features (BatchNorm1d)."""
    t = OrderedDict()
    t["conv1.weight"] = (widths[0], 3, 3, 3)
    _bn(t, "bn1", widths[0])
    t["prelu.weight"] = (widths[0],)
    h, w = size
    inplanes = widths[0]
    for stage, (blocks, planes) in enumerate(zip(layers, widths), 1):
        for b in range(blocks):
            k, cin = f"layer{stage}.{b}", inplanes if b == 0 else planes
            _bn(t, k + ".bn1", cin)
            t[k + ".conv1.weight"] = (planes, cin, 3, 3)
            _bn(t, k + ".bn2", planes)
            t[k + ".prelu.weight"] = (planes,)
            t[k + ".conv2.weight"] = (planes, planes, 3, 3)
            _bn(t, k + ".bn3", planes)
            if b == 0:
                t[k + ".downsample.0.weight"] = (planes, cin, 1, 1)
                _bn(t, k + ".downsample.1", planes)
        inplanes = planes
        h, w = conv_out(h, 3, 2, 1), conv_out(w, 3, 2, 1)
    _bn(t, "bn2", inplanes)
    t["fc.weight"] = (embedding, inplanes * h * w)
    t["fc.bias"] = (embedding,)
    _bn(t, "features", embedding)
    return t


def mbf_table(blocks, scale, embedding, size=ARCFACE):
    """mobilefacenet.py: ConvBlock = layers.{0 conv, 1 BN, 2 PReLU}, LinearBlock = layers.{0, 1};
    DepthWise(in, out, groups) = layers.{0 ConvBlock 1x1 -> groups, 1 ConvBlock 3x3 depthwise,
    2 LinearBlock 1x1 -> out}; Residual = layers.{i} DepthWise; conv_sep ConvBlock 1x1 -> 512;
    GDC = features.layers.{0 LinearBlock (depthwise 7x7 over the final map), 1 Flatten,
    2 Linear (no bias), 3 BatchNorm1d}."""
    t = OrderedDict()

    def conv_block(k, cin, cout, kernel, groups=1, prelu=True):
        t[k + ".layers.0.weight"] = (cout, cin // groups) + tuple(kernel)
        _bn(t, k + ".layers.1", cout)
        if prelu:
            t[k + ".layers.2.weight"] = (cout,)

    def depthwise(k, cin, cout, groups):
        conv_block(k + ".layers.0", cin, groups, (1, 1))
        conv_block(k + ".layers.1", groups, groups, (3, 3), groups=groups)
        conv_block(k + ".layers.2", groups, cout, (1, 1), prelu=False)

    def residual(k, c, n, groups):
        for i in range(n):
            depthwise(f"{k}.layers.{i}", c, c, groups)

    narrow, wide = 64 * scale, 128 * scale
    conv_block("layers.0", 3, narrow, (3, 3))
    if blocks[0] == 1:
        conv_block("layers.1", narrow, narrow, (3, 3), groups=64)
    else:
        residual("layers.1", narrow, blocks[0], 128)
    depthwise("layers.2", narrow, narrow, 128)
    residual("layers.3", narrow, blocks[1], 128)
    depthwise("layers.4", narrow, wide, 256)
    residual("layers.5", wide, blocks[2], 256)
    depthwise("layers.6", wide, wide, 512)
    residual("layers.7", wide, blocks[3], 256)
    conv_block("conv_sep", wide, 512, (1, 1))
    h, w = size
    for _ in range(4):  # the stride-2 3x3 convs of layers.0, 2, 4 and 6
        h, w = conv_out(h, 3, 2, 1), conv_out(w, 3, 2, 1)
    conv_block("features.layers.0", 512, 512, (h, w), groups=512, prelu=False)
    t["features.layers.2.weight"] = (embedding, 512)
    _bn(t, "features.layers.3", embedding)
    return t


def vit_table(dim, depth, embedding, size=ARCFACE, patch=9):
    """vit.py: pos_embed, mask_token (the model's own parameters, first); patch_embed.proj (conv,
    bias); blocks.{i}: norm1, attn.qkv (no bias), attn.proj, norm2, mlp.fc1 (4D), mlp.fc2; norm;
    feature.{0 Linear(L*D -> D, no bias), 1 BatchNorm1d(D), 2 Linear(D -> E, no bias),
    3 BatchNorm1d(E)}."""
    tokens = (size[0] // patch) * (size[1] // patch)
    t = OrderedDict([("pos_embed", (1, tokens, dim)), ("mask_token", (1, 1, dim)),
                     ("patch_embed.proj.weight", (dim, 3, patch, patch)),
                     ("patch_embed.proj.bias", (dim,))])
    for i in range(depth):
        b = f"blocks.{i}."
        t.update([(b + "norm1.weight", (dim,)), (b + "norm1.bias", (dim,)),
                  (b + "attn.qkv.weight", (3 * dim, dim)),
                  (b + "attn.proj.weight", (dim, dim)), (b + "attn.proj.bias", (dim,)),
                  (b + "norm2.weight", (dim,)), (b + "norm2.bias", (dim,)),
                  (b + "mlp.fc1.weight", (4 * dim, dim)), (b + "mlp.fc1.bias", (4 * dim,)),
                  (b + "mlp.fc2.weight", (dim, 4 * dim)), (b + "mlp.fc2.bias", (dim,))])
    t["norm.weight"], t["norm.bias"] = (dim,), (dim,)
    t["feature.0.weight"] = (dim, tokens * dim)
    _bn(t, "feature.1", dim)
    t["feature.2.weight"] = (embedding, dim)
    _bn(t, "feature.3", embedding)
    return t


def arcface_table(name, embedding=512, size=ARCFACE):
    if name in IRESNETS:
        return iresnet_table(IRESNETS[name], embedding, size)
    if name in MBFS:
        return mbf_table(*MBFS[name], embedding, size)
    if name in VITS:
        return vit_table(*VITS[name], embedding, size)
    spec = PLSC_ONLY[name]
    if spec[0] == "iresnet":
        return iresnet_table(spec[1], embedding, size, widths=spec[2])
    return vit_table(spec[1], spec[2], embedding, size, patch=spec[3])


def test_tables_have_arcface_torchs_published_sizes():
    # iresnet.py: fc = Linear(512 * fc_scale, E) with fc_scale = 7 * 7; GDC's 7x7 kernel; 144 tokens
    assert iresnet_table(IRESNETS["r50"], 512)["fc.weight"] == (512, 512 * 7 * 7)
    assert mbf_table(*MBFS["mbf"], 512)["features.layers.0.layers.0.weight"] == (512, 1, 7, 7)
    assert vit_table(256, 12, 512)["pos_embed"] == (1, 144, 256)
    # arcface_torch's published parameter counts are not stated; its layer counts are: r50 has
    # 3 + 4 + 14 + 3 = 24 blocks of 3 convs, 4 with a shortcut conv, and the stem conv
    convs = [k for k, s in iresnet_table(IRESNETS["r50"], 512).items() if len(s) == 4]
    assert len(convs) == 24 * 2 + 4 + 1


def distinct_values(table, counters=0):
    """Every float element distinct: consecutive float32 bit patterns from 0x30000000 (about
    4.7e-10; normal numbers, finite for 2^28 elements); `num_batches_tracked` int64 `counters`."""
    out, n = OrderedDict(), 0
    for key, shape in table.items():
        if key.endswith("num_batches_tracked"):
            out[key] = np.array(counters, np.int64)
            continue
        size = int(np.prod(shape, dtype=np.int64))
        bits = np.arange(0x30000000 + n, 0x30000000 + n + size, dtype=np.uint32)
        out[key] = bits.view(np.float32).reshape(shape)
        n += size
    assert n < 1 << 28
    return out


# ---------------------------------------------------------------- where values land in plsc

def plsc_key(fam, key):
    """The plsc state_dict key holding arcface_torch's `key`, and whether it is transposed
    (Paddle's Linear weight is [in, out])."""
    key = re.sub(r"\.running_mean$", "._mean", key)
    key = re.sub(r"\.running_var$", "._variance", key)
    if fam == "iresnet":
        transposed = key == "fc.weight"
        key = re.sub(r"^features\.(_mean|_variance)$", r"features.norm.\1", key)  # FrozenScale BN
        key = re.sub(r"prelu\.weight$", "prelu._weight", key)
    elif fam == "mbf":
        transposed = key == "features.layers.2.weight"
        for torch_name, plsc_name in (("features.layers.0.layers.0.", "features.dw."),
                                      ("features.layers.0.layers.1.", "features.bn."),
                                      ("features.layers.2.", "features.linear."),
                                      ("features.layers.3.", "features.features.")):
            if key.startswith(torch_name):
                return plsc_name + key[len(torch_name):], transposed
        # Residual: layers.s.layers.i.layers.j.layers.k -> layers.s.i.layers.j.k
        key, n = re.subn(r"^layers\.(\d+)\.layers\.(\d+)\.layers\.(\d+)\.layers\.(\d+)\.",
                         r"layers.\1.\2.layers.\3.\4.", key)
        if not n:  # DepthWise: layers.s.layers.j.layers.k -> layers.s.layers.j.k
            key, n = re.subn(r"^layers\.(\d+)\.layers\.(\d+)\.layers\.(\d+)\.",
                             r"layers.\1.layers.\2.\3.", key)
        if not n:  # ConvBlock: layers.s.layers.k, conv_sep.layers.k -> layers.s.k, conv_sep.k
            key = re.sub(r"^(layers\.\d+|conv_sep)\.layers\.(\d+)\.", r"\1.\2.", key)
        key = re.sub(r"\.2\.weight$", ".2._weight", key)  # a ConvBlock's PReLU is its third layer
    else:
        transposed = bool(re.search(r"(qkv|proj|fc1|fc2)\.weight$|^feature\.[02]\.weight$", key))
        transposed = transposed and key != "patch_embed.proj.weight"
    return key, transposed


def check_plsc_values(model, fam, state):
    """Every torch value is in plsc where `plsc_key` says, bit for bit."""
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    seen = set()
    for key, value in state.items():
        if key.endswith("num_batches_tracked"):
            continue
        where, transposed = plsc_key(fam, key)
        assert where in params, (key, where)
        want = value.T if transposed else value
        got = params[where]
        assert got.dtype == np.float32 and got.shape == want.shape, (key, where, got.shape)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (key, where)
        seen.add(where)
    assert seen == set(params)  # nothing in plsc left at its initial value


def lazy(name, **kwargs):
    with paddle.LazyGuard():
        return build_model(name, **kwargs)


# ---------------------------------------------------------------- layout of every name

@pytest.mark.parametrize("name", ALL_NAMES)
def test_layout_is_arcface_torchs_for_every_name(name):
    size = (56, 56) if name == "ViTDemo" else ARCFACE
    table = arcface_table(name, 512, size)
    model = lazy(name, embedding_size=512, input_size=size)
    got = [(e.torch_key, e.shape) for e in insightface_layout(model)]
    assert got == list(table.items())  # the same keys, shapes and order


@pytest.mark.parametrize("name,size", [("r50", (56, 56)), ("r100", (96, 80)), ("mbf", (64, 48)),
                                       ("mbf_large", (56, 56)), ("vit_s", (54, 36)),
                                       ("vit_t", (60, 61))])
def test_layout_at_other_input_sizes(name, size):
    model = lazy(name, embedding_size=256, input_size=size)
    got = [(e.torch_key, e.shape) for e in insightface_layout(model)]
    assert got == list(arcface_table(name, 256, size).items())


# ---------------------------------------------------------------- values, there and back

ROUND_TRIPS = [("r18", ARCFACE, 512), ("r34", ARCFACE, 128), ("r50", ARCFACE, 512),
               ("mbf", ARCFACE, 512), ("mbf_large", ARCFACE, 256), ("vit_t", ARCFACE, 384),
               ("IResNetTiny", (32, 24), 64),
               ("ViTDemo", (56, 56), 96)]


@pytest.mark.parametrize("name,size,embedding", ROUND_TRIPS)
def test_round_trip_bit_for_bit(name, size, embedding, tmp_path):
    table = arcface_table(name, embedding, size)
    state = distinct_values(table)
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torchfile.save(state, src)
    model = from_insightface(name, str(src), input_size=None if size == ARCFACE else size)
    assert model.embedding_size == embedding and tuple(model.input_size) == size  # from the file
    check_plsc_values(model, family(name), state)
    arcface = name not in PLSC_ONLY
    to_insightface(model, str(dst), name=name if arcface else None)
    back = torchfile.load(str(dst))
    assert list(back) == list(table)
    for key, value in state.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape, key
        assert back[key].tobytes() == value.tobytes(), key


def test_named_values_land_where_arcface_torch_has_them(tmp_path):
    """A few explicit ones, spelled out: a Linear's transpose, BatchNorm statistics, PReLU
    slopes, the frozen-scale embedding BN and MobileFaceNet's nested names."""
    table = arcface_table("IResNetTiny", 64, (32, 24))
    state = distinct_values(table)
    model = from_insightface("IResNetTiny", state, input_size=(32, 24))
    p = {k: v.numpy() for k, v in model.state_dict().items()}
    assert p["fc.weight"].shape == (128 * 2 * 2, 64)
    assert np.array_equal(p["fc.weight"], state["fc.weight"].T)
    assert np.array_equal(p["layer2.0.bn3._variance"], state["layer2.0.bn3.running_var"])
    assert np.array_equal(p["layer2.0.bn3._mean"], state["layer2.0.bn3.running_mean"])
    assert np.array_equal(p["layer3.0.prelu._weight"], state["layer3.0.prelu.weight"])
    assert np.array_equal(p["features.weight"], state["features.weight"])
    assert np.array_equal(p["features.norm._variance"], state["features.running_var"])

    state = distinct_values(arcface_table("mbf", 512))
    p = {k: v.numpy() for k, v in from_insightface("mbf", state).state_dict().items()}
    assert np.array_equal(p["features.linear.weight"], state["features.layers.2.weight"].T)
    assert np.array_equal(p["features.dw.weight"], state["features.layers.0.layers.0.weight"])
    assert np.array_equal(p["layers.3.2.layers.1.1._variance"],
                          state["layers.3.layers.2.layers.1.layers.1.running_var"])
    assert np.array_equal(p["layers.0.2._weight"], state["layers.0.layers.2.weight"])

    state = distinct_values(arcface_table("ViTDemo", 96, (56, 56)))
    p = {k: v.numpy() for k, v in
         from_insightface("ViTDemo", state, input_size=(56, 56)).state_dict().items()}
    assert np.array_equal(p["blocks.1.attn.proj.weight"], state["blocks.1.attn.proj.weight"].T)
    assert np.array_equal(p["feature.3._variance"], state["feature.3.running_var"])


def test_counters_dropped_wrappers_and_ddp_prefix(tmp_path):
    table = arcface_table("IResNetTiny", 32, (16, 16))
    state = distinct_values(table, counters=12345)
    wrapped = {"state_dict": OrderedDict(("module." + k, v) for k, v in state.items())}
    torchfile.save(wrapped, tmp_path / "ddp.pth")
    model = from_insightface("IResNetTiny", str(tmp_path / "ddp.pth"), input_size=16)
    check_plsc_values(model, "iresnet", state)
    to_insightface(model, str(tmp_path / "out.pt"))
    back = torchfile.load(str(tmp_path / "out.pt"))
    counters = [k for k in table if k.endswith("num_batches_tracked")]
    assert counters and all(back[k].dtype == np.int64 and back[k].shape == () and back[k] == 0
                            for k in counters)
    # without any counters (some exports drop them), and arcface_torch's training checkpoint
    bare = {"state_dict_backbone": {k: v for k, v in state.items() if k not in counters},
            "global_step": 10}
    check_plsc_values(from_insightface("IResNetTiny", bare, input_size=16), "iresnet", state)


def test_weights_into_a_built_backbone_and_16_bit_values():
    table = arcface_table("IResNetTiny", 32, (16, 16))
    state = distinct_values(table)
    half = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in state.items()}
    model = build_model("IResNetTiny", embedding_size=32, input_size=16)
    assert from_insightface(model, half) is model
    p = model.state_dict()
    assert np.array_equal(p["fc.weight"].numpy(), half["fc.weight"].T.astype(np.float32))
    with pytest.raises(ValueError, match="given by name"):
        from_insightface(model, half, input_size=16)


# ---------------------------------------------------------------- one-line errors

def _error(fn, *args, **kwargs):
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_shape_mismatch_names_key_shapes_model_and_size(tmp_path):
    state = distinct_values(arcface_table("IResNetTiny", 64, (32, 32)))  # 128 x 2 x 2 into fc
    torchfile.save(state, tmp_path / "tiny.pt")
    message = _error(from_insightface, "IResNetTiny", str(tmp_path / "tiny.pt"), input_size=48)
    assert message.startswith(f"{tmp_path / 'tiny.pt'}: arcface_torch key 'fc.weight' has shape "
                              f"[64, 512], expected [64, 1152]")  # 48 -> 3 x 3 x 128
    assert "IResNet" in message and "48x48" in message and "set the input size" in message

    vit = distinct_values(arcface_table("ViTDemo", 32, (56, 56)))
    message = _error(from_insightface, "ViTDemo", vit, input_size=64)
    assert "'pos_embed' has shape [1, 49, 128], expected [1, 64, 128]" in message
    assert "'feature.0.weight' has shape [128, 6272], expected [128, 8192]" in message

    mbf = distinct_values(arcface_table("mbf", 128))
    mbf["layers.2.layers.1.layers.0.weight"] = np.zeros((128, 1, 5, 5), np.float32)
    message = _error(from_insightface, "mbf", mbf, source="mbf.pt")
    assert message.startswith("mbf.pt: arcface_torch key 'layers.2.layers.1.layers.0.weight' has "
                              "shape [128, 1, 5, 5], expected [128, 1, 3, 3] for MobileFaceNet")
    assert "input size" not in message


def test_missing_and_unexpected_keys_are_listed():
    state = distinct_values(arcface_table("IResNetTiny", 32, (16, 16)))
    del state["layer2.0.bn3.running_var"]
    state["head.weight"] = np.zeros((3, 3), np.float32)
    message = _error(from_insightface, "IResNetTiny", state, input_size=16)
    assert message.startswith("state_dict: 1 arcface_torch key(s) missing: "
                              "'layer2.0.bn3.running_var'; 1 unexpected: 'head.weight' for IResNet")

    mbf = distinct_values(arcface_table("mbf", 512))  # the wrong model
    message = _error(from_insightface, "r18", mbf, source="mbf.pth")
    assert message.startswith("mbf.pth: ") and "missing: 'conv1.weight'" in message
    assert "unexpected: 'layers.0.layers.0.weight'" in message and "more" in message


def test_to_insightface_checks_the_arcface_architecture(tmp_path):
    out = str(tmp_path / "x.pt")
    message = _error(to_insightface, build_model("r18", input_size=56), out, name="r18")
    assert "is not arcface_torch's r18" in message and "'fc.weight'" in message
    message = _error(to_insightface, build_model("IResNetTiny", input_size=112), out, name="r18")
    assert "is not arcface_torch's r18" in message
    message = _error(to_insightface, build_model("ViTDemo", input_size=56), out, name="ViTDemo")
    assert "arcface_torch has no ViTDemo" in message
    assert not os.path.exists(out)


# ---------------------------------------------------------------- the file torch reads

@pytest.mark.parametrize("name,embedding", [("r18", 512), ("mbf", 128), ("vit_t", 512)])
def test_torch_loads_the_file(name, embedding, tmp_path):
    torch = pytest.importorskip("torch")
    model = build_model(name, embedding_size=embedding)
    path = str(tmp_path / f"{name}.pt")
    to_insightface(model, path, name=name)
    state = torch.load(path, weights_only=True)
    table = arcface_table(name, embedding)
    assert list(state) == list(table)
    for key, shape in table.items():
        counter = key.endswith("num_batches_tracked")
        assert state[key].dtype == (torch.int64 if counter else torch.float32), key
        assert tuple(state[key].shape) == shape, key
    torch_key, paddle_key = {"r18": ("fc.weight", "fc.weight"),
                             "mbf": ("conv_sep.layers.1.running_var", "conv_sep.1._variance"),
                             "vit_t": ("feature.0.weight", "feature.0.weight")}[name]
    want = model.state_dict()[paddle_key].numpy()
    assert np.array_equal(state[torch_key].numpy(), want.T if want.ndim == 2 else want)


# ---------------------------------------------------------------- Global.pretrained and the tool

def test_is_torch_file(tmp_path):
    torchfile.save({"a": np.zeros(2, np.float32)}, tmp_path / "weights.bin")
    paddle.save({"a": paddle.zeros([2])}, str(tmp_path / "weights.pdparams"))
    assert is_torch_file(tmp_path / "weights.bin")  # by its zip magic
    assert not is_torch_file(tmp_path / "weights.pdparams")
    assert is_torch_file(tmp_path / "absent.pth")  # by its name


def test_load_pretrained_reads_pt_and_pdparams(tmp_path):
    state = distinct_values(arcface_table("IResNetTiny", 32, (16, 16)))
    torchfile.save(state, tmp_path / "arcface.pt")
    model = build_model("IResNetTiny", embedding_size=32, input_size=16)
    builders.load_pretrained(model, str(tmp_path / "arcface.pt"))
    check_plsc_values(model, "iresnet", state)
    paddle.save(model.state_dict(), str(tmp_path / "plsc.pdparams"))
    other = build_model("IResNetTiny", embedding_size=32, input_size=16)
    builders.load_pretrained(other, str(tmp_path / "plsc.pdparams"))
    check_plsc_values(other, "iresnet", state)
    wrong = build_model("IResNetTiny", embedding_size=32, input_size=32)
    with pytest.raises(ConfigError, match=r"^Global.pretrained: .*arcface.pt: arcface_torch key "
                       r"'fc.weight' has shape \[32, 128\], expected \[32, 512\]"):
        builders.load_pretrained(wrong, str(tmp_path / "arcface.pt"))


def test_trainer_and_tasks_start_from_an_arcface_torch_file(tmp_path):
    from trainer_common import IMAGE, config, make_data
    from plsc.apps.tasks import trained_backbone
    from plsc.train import Trainer
    state = distinct_values(arcface_table("IResNetTiny", 32, (IMAGE, IMAGE)))
    torchfile.save(state, tmp_path / "arcface.pth")
    cfg = config(make_data(str(tmp_path / "data")), str(tmp_path / "out"),
                 Global={"pretrained": str(tmp_path / "arcface.pth"), "checkpoint": None})
    check_plsc_values(Trainer(cfg).backbone, "iresnet", state)
    check_plsc_values(trained_backbone(cfg), "iresnet", state)


def _tool(capsys, *args):
    """tools/convert_weights.py's main in this process: (exit code, stdout, stderr)."""
    tool = scripts.load(TOOL)
    capsys.readouterr()
    code = tool.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_convert_weights_tool_both_ways(tmp_path, capsys):
    table = arcface_table("mbf", 128)
    state = distinct_values(table)
    torchfile.save(state, tmp_path / "mbf.pt")
    code, out, err = _tool(capsys, "--to-plsc", tmp_path / "mbf.pt", "--model", "mbf",
                           "--output", tmp_path / "mbf.pdparams")
    assert code == 0, err
    assert "MobileFaceNet (128-d embeddings, 112x112 images)" in out
    model = build_model("mbf", embedding_size=128)
    model.set_state_dict(paddle.load(str(tmp_path / "mbf.pdparams")))
    check_plsc_values(model, "mbf", state)
    code, out, err = _tool(capsys, "--to-insightface", tmp_path / "mbf.pdparams", "--model", "mbf",
                           "--output", tmp_path / "back.pt")
    assert code == 0, err
    assert "get_model('mbf', num_features=128)" in out
    back = torchfile.load(str(tmp_path / "back.pt"))
    assert list(back) == list(table)
    assert all(back[k].tobytes() == v.tobytes() for k, v in state.items())


def test_convert_weights_tool_errors_are_one_line(tmp_path, capsys):
    state = distinct_values(arcface_table("IResNetTiny", 32, (16, 16)))
    torchfile.save(state, tmp_path / "tiny.pt")
    code, out, err = _tool(capsys, "--to-plsc", tmp_path / "tiny.pt", "--model", "IResNetTiny",
                           "--input-size", 32, "--output", tmp_path / "x.pdparams")
    assert code == 2 and err.count("\n") == 1 and "'fc.weight' has shape [32, 128]" in err
    assert not os.path.exists(tmp_path / "x.pdparams")
    code, out, err = _tool(capsys, "--to-plsc", tmp_path / "absent.pt", "--model", "r50",
                           "--output", tmp_path / "x.pdparams")
    assert code == 2 and err.count("\n") == 1 and "absent.pt" in err
    code, out, err = _tool(capsys, "--to-plsc", tmp_path / "tiny.pt", "--model", "r51",
                           "--output", tmp_path / "x.pdparams")
    assert code == 2 and err.count("\n") == 1 and "unknown model 'r51'" in err
    code, out, err = _tool(capsys, "--to-insightface", tmp_path / "tiny.pt",
                           "--output", tmp_path / "y.pt")
    assert code == 2 and err.count("\n") == 1 and "--model" in err


def test_convert_weights_tool_reads_a_checkpoint_folder(tmp_path, capsys):
    from plsc.checkpoint import CheckpointManager
    state = distinct_values(arcface_table("IResNetTiny", 32, (16, 24)))
    model = from_insightface("IResNetTiny", state, input_size=(16, 24))
    meta = {"model": "IResNetTiny", "embedding_size": 32, "num_classes": 1, "head_arrays": [],
            "config": {"Data": {"image_size": [16, 24]}}}
    folder = CheckpointManager(str(tmp_path)).save(7, meta, model.state_dict(),
                                                   {"lr": paddle.zeros([1])}, {})
    code, out, err = _tool(capsys, "--to-insightface", folder, "--output", tmp_path / "tiny.pt")
    assert code == 0, err
    assert "IResNetTiny (32-d embeddings, 16x24 images)" in out
    assert "note: arcface_torch has no IResNetTiny" in out
    back = torchfile.load(str(tmp_path / "tiny.pt"))
    assert list(back) == list(state) and all(back[k].tobytes() == v.tobytes()
                                             for k, v in state.items())
    code, out, err = _tool(capsys, "--to-insightface", folder, "--model", "r18",
                           "--output", tmp_path / "r18.pt")
    assert code == 2 and "holds the backbone IResNetTiny, not IResNet18" in err
