"""Face ViTs (plsc/models/vit.py) against arcface_torch's published architecture.

Oracles:
- ARCFACE_VITS: the `vit_*` entries of arcface_torch's `backbones/get_model`
  (deepinsight/insightface, recognition/arcface_torch/backbones/__init__.py): embed_dim,
  depth, drop_path_rate, mask_ratio; every one with num_heads 8, patch 9 at 112x112, LayerNorm.
- `expected_state_dict`: the key -> shape table of arcface_torch's `VisionTransformer`
  (backbones/vit.py), written out here from D, depth, tokens and embedding size, in Paddle's
  conventions (Linear weight [in, out]; BatchNorm `_mean`/`_variance`).
- numpy float64 forward passes written below from that description (patch conv, pre-norm
  blocks, 8-head attention, ReLU6 MLP, final LayerNorm, flatten, Linear/BN/Linear/BN); only
  the weights are read from the model, by state_dict key.
- Masking counts from arcface_torch's formula, len_keep = int(L * (1 - mask_ratio)).
"""
import plsc  # noqa: F401  -- before Paddle, for its CPU set-up
import numpy as np
import paddle
import pytest

from plsc import config as plsc_config
from plsc import parts as builders
from plsc.config import ConfigError
from plsc.models import ALIASES, MODELS, VisionTransformer, build_model, resolve_name
from plsc.models import vit as vit_module

# arcface_torch name -> (embed_dim, depth, drop_path_rate, mask_ratio), from get_model.
ARCFACE_VITS = {
    "vit_t": (256, 12, 0.1, 0.1),
    "vit_t_dp005_mask0": (256, 12, 0.05, 0.0),
    "vit_s": (512, 12, 0.1, 0.1),
    "vit_s_dp005_mask_0": (512, 12, 0.05, 0.0),
    "vit_b": (512, 24, 0.1, 0.1),
    "vit_b_dp005_mask_005": (512, 24, 0.05, 0.05),
    "vit_l_dp005_mask_005": (768, 24, 0.05, 0.05),
    "vit_h": (1024, 48, 0.1, 0.0),
}
HEADS, PATCH, IMAGE = 8, 9, 112
TOKENS = (IMAGE // PATCH) ** 2  # 12 x 12 = 144
# The CPU demo ViT (not in arcface_torch): D 128, depth 4, patch 8, drop path 0.05, no mask.
DEMO = ("ViTDemo", 128, 4, 8, 0.05, 0.0)

LN_EPS, BN_EPS = 1e-5, 2e-5  # torch LayerNorm default; the feature head's BatchNorm1d(eps=2e-5)


@pytest.fixture(autouse=True)
def _seed():
    paddle.seed(0)


def expected_state_dict(dim, depth, tokens, embedding, patch=PATCH):
    """arcface_torch's VisionTransformer state_dict (Paddle shapes and BN names)."""
    shapes = {"pos_embed": [1, tokens, dim], "mask_token": [1, 1, dim],
              "patch_embed.proj.weight": [dim, 3, patch, patch], "patch_embed.proj.bias": [dim],
              "norm.weight": [dim], "norm.bias": [dim],
              "feature.0.weight": [tokens * dim, dim], "feature.2.weight": [dim, embedding]}
    for i in range(depth):
        b = f"blocks.{i}."
        shapes.update({b + "norm1.weight": [dim], b + "norm1.bias": [dim],
                       b + "attn.qkv.weight": [dim, 3 * dim],  # no qkv bias
                       b + "attn.proj.weight": [dim, dim], b + "attn.proj.bias": [dim],
                       b + "norm2.weight": [dim], b + "norm2.bias": [dim],
                       b + "mlp.fc1.weight": [dim, 4 * dim], b + "mlp.fc1.bias": [4 * dim],
                       b + "mlp.fc2.weight": [4 * dim, dim], b + "mlp.fc2.bias": [dim]})
    for key, width in (("feature.1.", dim), ("feature.3.", embedding)):
        for name in ("weight", "bias", "_mean", "_variance"):
            shapes[key + name] = [width]
    return shapes


def lazy(name, **kwargs):
    """A full-size model without allocating its weights (ViT-H has 756M)."""
    with paddle.LazyGuard():
        return build_model(name, **kwargs)


# ---------------------------------------------------------------- names and layout

@pytest.mark.parametrize("alias", list(ARCFACE_VITS))
def test_state_dict_matches_arcface_torch(alias):
    dim, depth, drop_path, mask = ARCFACE_VITS[alias]
    model = lazy(alias, embedding_size=512)
    got = {k: list(v.shape) for k, v in model.state_dict().items()}
    want = expected_state_dict(dim, depth, TOKENS, 512)
    assert sorted(set(got) - set(want)) == [] and sorted(set(want) - set(got)) == []
    assert got == want
    assert model.num_heads == HEADS and model.patch_size == PATCH
    assert model.mask_ratio == mask
    np.testing.assert_allclose([b.drop_path.p for b in model.blocks],
                               np.linspace(0.0, drop_path, depth), rtol=1e-12, atol=0)


def test_registry_names():
    assert set(ARCFACE_VITS) <= set(ALIASES)
    canonical = {"vit_t": "ViT_T", "vit_t_dp005_mask0": "ViT_T_DP005_Mask0", "vit_s": "ViT_S",
                 "vit_s_dp005_mask_0": "ViT_S_DP005_Mask0", "vit_b": "ViT_B",
                 "vit_b_dp005_mask_005": "ViT_B_DP005_Mask005",
                 "vit_l_dp005_mask_005": "ViT_L_DP005_Mask005", "vit_h": "ViT_H"}
    for alias, name in canonical.items():
        assert resolve_name(alias) == name and resolve_name(name.lower()) == name
        assert resolve_name(alias.upper()) == name
    assert {n for n in MODELS if "vit" in n.lower()} == set(canonical.values()) | {"ViTDemo"}


def test_demo_model_layout_and_56px_tokens():
    name, dim, depth, patch, drop_path, mask = DEMO
    model = build_model(name, input_size=(56, 56), embedding_size=128)
    got = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert got == expected_state_dict(dim, depth, (56 // patch) ** 2, 128, patch)  # 49 tokens
    assert model.mask_ratio == mask and model.blocks[-1].drop_path.p == pytest.approx(drop_path)
    assert list(model(paddle.randn([3, 3, 56, 56])).shape) == [3, 128]
    seven = build_model(name, input_size=(56, 56), patch_size=7, embedding_size=16)
    assert list(seven.pos_embed.shape) == [1, 64, dim]  # 8 x 8


@pytest.mark.parametrize("input_size,patch,tokens", [((112, 112), 9, 144), ((64, 48), 8, 48),
                                                     ((29, 20), 9, 6)])
def test_output_shape_and_token_count(input_size, patch, tokens):
    model = VisionTransformer(embedding_size=24, input_size=input_size, embed_dim=16, depth=1,
                              patch_size=patch, mask_ratio=0.1, drop_path_rate=0.1)
    assert model.num_patches == tokens and list(model.pos_embed.shape) == [1, tokens, 16]
    x = paddle.randn([3, 3, *input_size])
    assert list(model(x).shape) == [3, 24]
    model.eval()
    assert list(model(x[:1]).shape) == [1, 24]
    with pytest.raises(ValueError, match="built for"):
        model(paddle.randn([1, 3, input_size[0] + patch, input_size[1]]))


def test_full_size_vit_t_forward():
    model = build_model("vit_t", embedding_size=512)
    x = paddle.randn([2, 3, IMAGE, IMAGE])
    assert list(model(x).shape) == [2, 512]
    model.eval()
    assert list(model(x).shape) == [2, 512]


def test_initialisation_follows_arcface_torch():
    model = build_model("ViTDemo", input_size=56, embedding_size=128)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    for key in ("feature.0.weight", "blocks.0.mlp.fc1.weight", "blocks.1.attn.qkv.weight"):
        assert abs(sd[key].std() / 0.02 - 1) < 0.02 and abs(sd[key].mean()) < 1e-3, key
    for key in ("pos_embed", "mask_token"):  # trunc-normal / normal, std 0.02 (8192 / 128 draws)
        assert abs(sd[key].std() / 0.02 - 1) < (0.05 if key == "pos_embed" else 0.3), key
    for key in ("blocks.0.attn.proj.bias", "blocks.2.mlp.fc1.bias", "blocks.2.mlp.fc2.bias",
                "norm.bias", "blocks.0.norm1.bias", "feature.1.bias", "feature.1._mean"):
        assert np.all(sd[key] == 0), key
    for key in ("norm.weight", "blocks.3.norm2.weight", "feature.3.weight", "feature.3._variance"):
        assert np.all(sd[key] == 1), key
    bound = 1 / np.sqrt(3 * 8 * 8)  # torch's Conv2d default: U(+-1/sqrt(fan_in)), weight and bias
    for key in ("patch_embed.proj.weight", "patch_embed.proj.bias"):
        assert np.abs(sd[key]).max() <= bound and np.abs(sd[key]).max() > 0.9 * bound, key
    bn = model.feature[1]
    assert bn._epsilon == BN_EPS and model.feature[3]._epsilon == BN_EPS


def test_feature_batch_norm_momentum_is_torchs_0_1():
    model = VisionTransformer(embedding_size=8, input_size=18, embed_dim=16, depth=1,
                              patch_size=9, mask_ratio=0.0)
    seen = []
    model.feature[1].register_forward_pre_hook(lambda layer, inp: seen.append(inp[0].numpy()))
    model(paddle.randn([6, 3, 18, 18]))
    # torch: running = (1 - 0.1) * running + 0.1 * batch statistic; the mean starts at 0.
    np.testing.assert_allclose(model.feature[1]._mean.numpy(), 0.1 * seen[0].mean(0),
                               rtol=1e-5, atol=1e-7)


def test_dropout_is_arcface_torchs_drop_rate():
    """`dropout` acts where arcface_torch's drop_rate does: after the position embedding, after
    the MLP's activation and after fc2, after the attention projection; not on the attention
    weights (attn_drop_rate, 0). Each place is seen through hooks: exact zeros at about the
    rate p where the undropped value is not zero, the others scaled by 1/(1 - p)."""
    p = 0.5
    model = VisionTransformer(embedding_size=8, input_size=36, embed_dim=32, depth=1,
                              patch_size=6, dropout=p, mask_ratio=0.0)
    block = model.blocks[0]
    assert block.attn.attn_drop.p == 0.0
    seen = {}

    def keep(name, pre=False):
        if pre:
            return lambda layer, inp: seen.__setitem__(name, inp[0].numpy())
        return lambda layer, inp, out: seen.__setitem__(name, out.numpy())
    model.patch_embed.register_forward_post_hook(keep("patches"))
    block.register_forward_pre_hook(keep("tokens", pre=True))
    block.mlp.act.register_forward_post_hook(keep("act"))
    block.mlp.fc2.register_forward_pre_hook(keep("fc2_in", pre=True))
    block.mlp.register_forward_post_hook(keep("mlp"))
    block.attn.register_forward_post_hook(keep("attn"))
    model(paddle.randn([8, 3, 36, 36]))

    def check_dropped(before, after):
        dropped = after == 0
        assert 0.4 < dropped[before != 0].mean() < 0.6
        np.testing.assert_allclose(after[~dropped], before[~dropped] / (1 - p), rtol=1e-6)
    check_dropped(seen["patches"] + model.pos_embed.numpy(), seen["tokens"])
    check_dropped(seen["act"], seen["fc2_in"])
    for name in ("mlp", "attn"):  # after fc2 and after the projection: zeros at about p
        assert 0.4 < (seen[name] == 0).mean() < 0.6, name
    model.eval()
    model(paddle.randn([8, 3, 36, 36]))
    assert (seen["attn"] != 0).all() and (seen["mlp"] != 0).all()


# ---------------------------------------------------------------- numpy reference

def _ln(x, w, b, eps=LN_EPS):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


class NumpyViT:
    """float64 forward of arcface_torch's ViT from the description; weights by key."""

    def __init__(self, model, heads=HEADS, patch=PATCH, ln_eps=LN_EPS, bn_eps=BN_EPS,
                 act=lambda h: np.clip(h, 0.0, 6.0)):
        self.p = {k: v.numpy().astype("float64") for k, v in model.state_dict().items()}
        self.depth = sum(k.endswith("norm1.weight") for k in self.p)
        self.heads, self.patch, self.ln_eps, self.bn_eps, self.act = heads, patch, ln_eps, bn_eps, act
        self.hidden = []  # MLP pre-activations, to show ReLU6's clip is exercised

    def tokens(self, images):
        """Patch conv (kernel = stride = patch), tokens row by row, + pos_embed: [B, L, D]."""
        w, b, p = self.p["patch_embed.proj.weight"], self.p["patch_embed.proj.bias"], self.patch
        gh, gw = images.shape[2] // p, images.shape[3] // p
        out = []
        for i in range(gh):
            for j in range(gw):
                patch = images[:, :, i * p:(i + 1) * p, j * p:(j + 1) * p]
                out.append(np.einsum("bcuv,dcuv->bd", patch, w) + b)
        return np.stack(out, 1) + self.p["pos_embed"]

    def attention(self, x, i):
        p, batch, length, dim = self.p, *x.shape
        hd = dim // self.heads
        qkv = x @ p[f"blocks.{i}.attn.qkv.weight"]  # [B, L, 3D]: q | k | v, heads contiguous
        q, k, v = (qkv[..., j * dim:(j + 1) * dim].reshape(batch, length, self.heads, hd)
                   .transpose(0, 2, 1, 3) for j in range(3))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        o = o.transpose(0, 2, 1, 3).reshape(batch, length, dim)
        return o @ p[f"blocks.{i}.attn.proj.weight"] + p[f"blocks.{i}.attn.proj.bias"]

    def mlp(self, x, i):
        p = self.p
        h = x @ p[f"blocks.{i}.mlp.fc1.weight"] + p[f"blocks.{i}.mlp.fc1.bias"]
        self.hidden.append(h)
        return self.act(h) @ p[f"blocks.{i}.mlp.fc2.weight"] + p[f"blocks.{i}.mlp.fc2.bias"]

    def branches(self, x, i):
        """(attention branch of x, a function giving the MLP branch of its argument)."""
        p = self.p
        attn = self.attention(_ln(x, p[f"blocks.{i}.norm1.weight"], p[f"blocks.{i}.norm1.bias"],
                                  self.ln_eps), i)
        return attn, lambda y: self.mlp(_ln(y, p[f"blocks.{i}.norm2.weight"],
                                            p[f"blocks.{i}.norm2.bias"], self.ln_eps), i)

    def blocks_and_norm(self, x):
        for i in range(self.depth):
            attn, mlp = self.branches(x, i)
            x = x + attn
            x = x + mlp(x)
        return _ln(x, self.p["norm.weight"], self.p["norm.bias"], self.ln_eps)

    def bn(self, key, x):
        p = self.p
        return ((x - p[key + "._mean"]) / np.sqrt(p[key + "._variance"] + self.bn_eps)
                * p[key + ".weight"] + p[key + ".bias"])

    def __call__(self, images):
        x = self.blocks_and_norm(self.tokens(images)).reshape(images.shape[0], -1)
        x = self.bn("feature.1", x @ self.p["feature.0.weight"])
        return self.bn("feature.3", x @ self.p["feature.2.weight"])


def _randomise(model, rng, token_scale=0.01, fc1_std=1.0):
    """Non-trivial weights: LayerNorm/BN affines, BN statistics with small variances (so that
    BN's eps shows), small patch tokens (so that the first LayerNorm's eps shows), and an fc1
    wide enough that ReLU6 clips."""
    for key, t in model.state_dict().items():
        shape = t.shape
        if key == "patch_embed.proj.weight":
            v = rng.normal(0, token_scale / np.sqrt(np.prod(shape[1:])), shape)
        elif key in ("patch_embed.proj.bias", "pos_embed"):
            v = rng.normal(0, token_scale, shape)
        elif key.endswith("._variance"):
            v = rng.uniform(1e-4, 1e-3, shape)
        elif key.endswith("._mean"):
            v = rng.normal(0, 0.01, shape)
        elif key.startswith("feature.0"):
            v = rng.normal(0, 0.02 / np.sqrt(shape[0]), shape)  # outputs ~ the BN's std
        elif "fc1.weight" in key:
            v = rng.normal(0, fc1_std, shape)
        elif key.endswith("norm1.weight") or key.endswith("norm2.weight") or key == "norm.weight" \
                or key in ("feature.1.weight", "feature.3.weight"):
            v = rng.uniform(0.5, 1.5, shape)
        elif key.endswith(".bias") or key == "mask_token":
            v = rng.normal(0, 0.1, shape)
        else:
            v = rng.normal(0, 1 / np.sqrt(shape[0]), shape)
        t.set_value(v.astype("float32"))


# float32 tolerance: every dot product here has at most L*D = 6*32 = 192 terms (feature.0) or
# 4D = 128; float32 rounds each step by 2^-24 ~ 6e-8, so an output is off by a few hundred
# times that relative to the scale of its terms (LayerNorm of tokens with std ~0.01 and BN with
# variances ~1e-4 amplify it by ~10-100): ~1e-5 at most. 2e-4 is above that and far below the
# effects the reference must tell apart (checked in the test: >= 2e-3).
REL_TOL = 2e-4


def _rel(a, b):
    return float(np.abs(np.asarray(a, "float64") - b).max() / np.abs(b).max())


def test_eval_forward_matches_numpy_reference():
    model = VisionTransformer(embedding_size=24, input_size=(29, 20), embed_dim=32, depth=2,
                              num_heads=8, patch_size=9, mask_ratio=0.1, drop_path_rate=0.1)
    rng = np.random.RandomState(3)
    _randomise(model, rng)
    model.eval()
    x = rng.normal(0, 1, (4, 3, 29, 20))
    got = model(paddle.to_tensor(x.astype("float32"))).numpy()
    ref = NumpyViT(model)
    want = ref(x)
    assert np.any(np.concatenate(ref.hidden) > 6) and np.any(np.concatenate(ref.hidden) < 0)
    assert _rel(got, want) < REL_TOL
    # the tolerance is far below what a wrong detail would change
    wrong = {"LayerNorm eps 1e-6": NumpyViT(model, ln_eps=1e-6),
             "BN eps 1e-5": NumpyViT(model, bn_eps=1e-5),
             "ReLU": NumpyViT(model, act=lambda h: np.maximum(h, 0)),
             "4 heads": NumpyViT(model, heads=4)}
    for what, other in wrong.items():
        assert _rel(other(x), want) > 10 * REL_TOL, what


# ---------------------------------------------------------------- masking

def _observe(model):
    """Hooks: the token count entering the first block, and per sample the positions of the
    final tokens (before feature.0) that are the mask token."""
    seen = {}
    model.blocks[0].register_forward_pre_hook(
        lambda layer, inp: seen.__setitem__("length", inp[0].shape[1]))

    def final(layer, inp):
        tokens = inp[0].numpy().reshape(inp[0].shape[0], model.num_patches, model.embed_dim)
        seen["tokens"] = tokens
        seen["masked"] = np.all(tokens == model.mask_token.numpy().reshape(1, 1, -1), axis=-1)
    model.feature[0].register_forward_pre_hook(final)
    return seen


@pytest.mark.parametrize("name,ratio,masked", [
    ("vit_t", None, 15),                # 144 tokens, int(144 * 0.9) = int(129.6) = 129 kept
    ("vit_b_dp005_mask_005", None, 8),  # int(144 * 0.95) = 136 kept (arcface_torch: 15)
    ("vit_t_dp005_mask0", None, 0),
    ("vit_t_dp005_mask0", 0.25, 36),    # the config's ratio, not the name's
    ("ViTDemo", None, 0),
    ("ViTDemo", 0.1, 49 - int(49 * 0.9)),  # 49 tokens at 56x56 with patch 8
])
def test_masking_replaces_the_given_share_in_training_only(name, ratio, masked):
    # The name's patch and ratio with a narrow, shallow transformer (embed_dim/depth overridden).
    size = 56 if name == "ViTDemo" else IMAGE
    model = build_model(name, input_size=size, embedding_size=8, embed_dim=16, depth=1,
                        mask_ratio=ratio, drop_path_rate=0.0)
    length = (size // model.patch_size) ** 2
    seen = _observe(model)
    x = paddle.randn([5, 3, size, size])
    model(x)
    assert seen["length"] == length - masked
    assert seen["masked"].sum(1).tolist() == [masked] * 5
    if masked:
        assert len({tuple(np.flatnonzero(m)) for m in seen["masked"]}) == 5  # per sample
    model.eval()
    model(x)
    assert seen["length"] == length and not seen["masked"].any()


def test_kept_tokens_return_to_their_places():
    """Attention is permutation-equivariant and position enters only through pos_embed, so
    a kept token's final value is the numpy forward of the kept tokens alone, at its place."""
    model = VisionTransformer(embedding_size=8, input_size=36, embed_dim=32, depth=2,
                              patch_size=6, mask_ratio=0.25, drop_path_rate=0.0)
    rng = np.random.RandomState(4)
    _randomise(model, rng, token_scale=1.0, fc1_std=0.2)
    seen = _observe(model)
    x = rng.normal(0, 1, (3, 3, 36, 36))
    model(paddle.to_tensor(x.astype("float32")))
    ref = NumpyViT(model, patch=6)
    tokens = ref.tokens(x)
    for b in range(3):
        kept = np.flatnonzero(~seen["masked"][b])
        assert len(kept) == int(36 * 0.75)
        want = ref.blocks_and_norm(tokens[b:b + 1, kept])[0]
        assert _rel(seen["tokens"][b, kept], want) < REL_TOL


def test_masks_and_drop_path_come_from_paddles_generator():
    model = VisionTransformer(embedding_size=8, input_size=36, embed_dim=16, depth=2,
                              patch_size=6, mask_ratio=0.5, drop_path_rate=0.5)
    seen = _observe(model)
    x = paddle.randn([8, 3, 36, 36])

    def draws(seed=None, state=None):
        """The final tokens: they differ when a mask or a drop-path draw does."""
        if seed is not None:
            paddle.seed(seed)
        if state is not None:
            paddle.set_rng_state(state)
        model(x)
        return seen["masked"].copy(), seen["tokens"].copy()
    np_state = np.random.get_state()
    first = draws(seed=11)
    for a, b in zip(draws(seed=11), first):
        np.testing.assert_array_equal(a, b)
    other = draws(seed=12)
    assert not np.array_equal(other[0], first[0]) and not np.array_equal(other[1], first[1])
    state = paddle.get_rng_state()  # what a checkpoint saves
    after = draws()
    for a, b in zip(draws(state=state), after):
        np.testing.assert_array_equal(a, b)
    after_np = np.random.get_state()  # numpy's global generator was not drawn from
    assert after_np[1].tolist() == np_state[1].tolist() and after_np[2] == np_state[2]
    # drop path alone (no masking; the last block's 2 x 8 draws at p = 0.5): the same seed,
    # the same draws
    model.mask_ratio = 0.0
    first = draws(seed=3)[1]
    np.testing.assert_array_equal(draws(seed=3)[1], first)
    assert not np.array_equal(draws(seed=4)[1], first)


# ---------------------------------------------------------------- drop path

def test_drop_path_per_sample_in_training_identity_in_eval():
    p, batch, length, dim = 0.5, 64, 5, 32
    block = vit_module.Block(dim, HEADS, drop_path=p)
    rng = np.random.RandomState(5)
    for key, t in block.state_dict().items():
        t.set_value(rng.normal(0.2 if "norm" in key and "weight" in key else 0,
                               0.3, t.shape).astype("float32"))
    x = rng.normal(0, 1, (batch, length, dim)).astype("float32")
    ref = NumpyViT(block)
    ref.p = {f"blocks.0.{k}": v for k, v in ref.p.items()}
    x64 = x.astype("float64")
    attn, mlp = ref.branches(x64, 0)
    scale = 1 / (1 - p)
    y1 = x64 + attn * scale  # attention branch kept, scaled by 1/(1-p)
    candidates = {(0, 0): x64, (1, 0): y1, (0, 1): x64 + mlp(x64) * scale,
                  (1, 1): y1 + mlp(y1) * scale}
    block.eval()  # eval: both branches, unscaled
    np.testing.assert_allclose(block(paddle.to_tensor(x)).numpy(),
                               x64 + attn + mlp(x64 + attn), rtol=0, atol=1e-5)
    block.train()
    out = block(paddle.to_tensor(x)).numpy()
    patterns = []
    for b in range(batch):
        errors = {k: np.abs(out[b] - c[b]).max() for k, c in candidates.items()}
        best = min(errors, key=errors.get)
        assert errors[best] < 1e-5 and sorted(errors.values())[1] > 1e-2, errors
        patterns.append(best)
        if best == (0, 0):  # both branches dropped: exactly the input
            np.testing.assert_array_equal(out[b], x[b])
    assert set(patterns) == set(candidates)  # each of the four patterns occurs (p = 0.5)


def test_drop_path_rate_rises_linearly():
    model = VisionTransformer(embedding_size=8, input_size=18, embed_dim=16, depth=5,
                              patch_size=9, drop_path_rate=0.3)
    np.testing.assert_allclose([b.drop_path.p for b in model.blocks],
                               [0.0, 0.075, 0.15, 0.225, 0.3], rtol=1e-12, atol=0)
    one = VisionTransformer(embedding_size=8, input_size=18, embed_dim=16, depth=1,
                            patch_size=9, drop_path_rate=0.3)
    assert one.blocks[0].drop_path.p == 0.0  # torch.linspace(0, r, 1) = [0]


# ---------------------------------------------------------------- float32 attention

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attention_softmax_in_float32_for_16_bit_qkv(dtype, monkeypatch):
    """Under AMP the qkv Linear yields 16-bit values; the scores, softmax and weighted sum must
    be float32 (arcface_torch: autocast off and .float()). Paddle's CPU AMP casts nothing and
    CPU has no 16-bit matmul or softmax, so AMP itself cannot run here: the qkv output is made
    16-bit by a hook, as AMP would, and the softmax's input dtype is recorded."""
    dim, length = 32, 6
    attn = vit_module.Attention(dim, HEADS)
    rng = np.random.RandomState(6)
    captured = {}

    def to_16_bit(layer, inp, out):
        out = out.astype(dtype)
        captured["qkv"] = out.astype("float32").numpy().astype("float64")
        return out
    attn.qkv.register_forward_post_hook(to_16_bit)
    dtypes = []
    real_softmax = vit_module.softmax_last

    def recording_softmax(x):
        dtypes.append(x.dtype)
        return real_softmax(x)
    monkeypatch.setattr(vit_module, "softmax_last", recording_softmax)
    x = rng.normal(0, 1, (2, length, dim)).astype("float32")
    out = attn(paddle.to_tensor(x))
    assert dtypes == [paddle.float32] and out.dtype == paddle.float32
    # numpy from the 16-bit qkv: heads of 4, q | k | v
    qkv = captured["qkv"]
    q, k, v = (qkv[..., j * dim:(j + 1) * dim].reshape(2, length, HEADS, 4).transpose(0, 2, 1, 3)
               for j in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / 2.0
    s = np.exp(s - s.max(-1, keepdims=True))
    o = ((s / s.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(2, length, dim)
    want = o @ attn.proj.weight.numpy().astype("float64") + attn.proj.bias.numpy()
    assert _rel(out.numpy(), want) < REL_TOL


# ---------------------------------------------------------------- config

def _cfg(model, image_size=(56, 56)):
    return plsc_config.validate({"Model": model, "Loss": {"num_classes": 10},
                                 "Data": {"root": "unused", "image_size": list(image_size)}})


def test_config_keys_override_the_names_values():
    default = builders.build_backbone(_cfg({"name": "ViTDemo", "embedding_size": 16}))
    assert default.patch_size == 8 and default.num_patches == 49 and default.mask_ratio == 0.0
    assert default.blocks[-1].drop_path.p == pytest.approx(0.05)
    model = builders.build_backbone(_cfg({"name": "vitdemo", "embedding_size": 16,
                                         "drop_path_rate": 0.3, "mask_ratio": 0.25,
                                         "patch_size": 7}))
    assert model.patch_size == 7 and list(model.pos_embed.shape) == [1, 64, 128]
    np.testing.assert_allclose([b.drop_path.p for b in model.blocks],
                               np.linspace(0, 0.3, 4), rtol=1e-12)
    seen = _observe(model)
    model(paddle.randn([2, 3, 56, 56]))
    assert seen["masked"].sum(1).tolist() == [64 - int(64 * 0.75)] * 2  # 16
    off = builders.build_backbone(_cfg({"name": "vit_t", "embedding_size": 16, "mask_ratio": 0,
                                       "patch_size": 28}, image_size=(112, 112)))
    assert off.mask_ratio == 0.0 and off.num_patches == 16 and off.embed_dim == 256


@pytest.mark.parametrize("key,value", [("drop_path_rate", 0.1), ("mask_ratio", 0.1),
                                       ("patch_size", 8)])
def test_vit_keys_are_refused_for_other_backbones(key, value):
    with pytest.raises(ConfigError, match=f"Model.{key}"):
        builders.build_backbone(_cfg({"name": "IResNetTiny", key: value}))
    with pytest.raises(ValueError, match=key):
        build_model("MobileFaceNet", **{key: value})
    assert build_model("IResNetTiny", input_size=32, **{key: None}) is not None


@pytest.mark.parametrize("key,value", [("drop_path_rate", -0.1), ("drop_path_rate", 1.5),
                                       ("mask_ratio", -0.5), ("mask_ratio", 2),
                                       ("patch_size", 0), ("patch_size", 7.5)])
def test_config_rejects_bad_vit_values(key, value):
    with pytest.raises(ConfigError, match=f"Model.{key}"):
        _cfg({"name": "ViTDemo", key: value})


def test_model_rejects_impossible_settings():
    with pytest.raises(ValueError, match="mask_ratio"):
        build_model("ViTDemo", input_size=56, mask_ratio=1.0)
    with pytest.raises(ValueError, match="patch_size"):
        build_model("ViTDemo", input_size=56, patch_size=57)
    with pytest.raises(ValueError, match="num_heads"):
        VisionTransformer(embed_dim=36, num_heads=8, input_size=18)


def test_to_static_export_of_the_demo_vit(tmp_path):
    model = build_model("ViTDemo", input_size=56, embedding_size=32, depth=1)
    model.eval()
    spec = [paddle.static.InputSpec([None, 3, 56, 56], "float32")]
    path = str(tmp_path / "vit")
    paddle.jit.save(paddle.jit.to_static(model, input_spec=spec, full_graph=True), path)
    loaded = paddle.jit.load(path)
    loaded.eval()
    x = paddle.randn([3, 3, 56, 56])
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-5)
