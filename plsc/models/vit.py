"""Face Vision Transformers, built as insightface's arcface_torch builds them
(`recognition/arcface_torch/backbones/vit.py`, the `vit_*` names of `backbones/get_model`).

    images [B, 3, H, W]
      -> patch embedding (a conv, kernel = stride = patch): tokens [B, L, D], L = (H//p)·(W//p)
      -> + learned position embedding, dropout
      -> training only, mask_ratio > 0: keep int(L·(1 − mask_ratio)) random tokens per sample
      -> `depth` pre-norm blocks: x += drop_path(attn(LN(x))); x += drop_path(mlp(LN(x)))
      -> LayerNorm (in float32); the removed tokens come back as the learned mask token
      -> flatten [B, L·D] -> Linear(D, no bias) -> BN -> Linear(embedding, no bias) -> BN
         (this feature head in float32, also under AMP)

No class token. Attention: qkv without bias, scores, softmax and the product with v in float32
(also under AMP), output projection with bias. MLP: D -> 4D -> D with ReLU6. Stochastic depth
rises linearly from 0 (first block) to `drop_path_rate` (last). At 112×112 with patch 9 there
are 144 tokens (a 12×12 grid; the last 4 pixel rows and columns are not seen, as in
arcface_torch).

Parameter names follow arcface_torch's state_dict one to one (`pos_embed`, `mask_token`,
`patch_embed.proj.*`, `blocks.{i}.{norm1,norm2,attn.qkv,attn.proj,mlp.fc1,mlp.fc2}.*`,
`norm.*`, `feature.{0,1,2,3}.*`); Paddle's BatchNorm calls the running statistics `_mean` and
`_variance` (torch: `running_mean`, `running_var`, plus `num_batches_tracked`), and a Paddle
Linear weight is `[in, out]`, the transpose of torch's `[out, in]` (conv weights have the same
layout in both).

Random draws (token masking, drop path, dropout) come from Paddle's global generator, so a
checkpoint that saves `paddle.get_rng_state()` resumes them exactly.

On the CPU kernel set the element-wise pieces run fused (`heads.split_heads`, q scaled as it
is copied, so the scores equal arcface_torch's up to float32 rounding; `linear_relu6`;
`residual`; `gather`); `PLSC_KERNELS=device` runs Paddle's ops in arcface_torch's order.
"""
import numpy as np
import paddle
from paddle import nn

from .batchnorm import BatchNorm1D
from .conv import Conv2D
from .gather import take_rows_per_sample
from .heads import split_heads, takes_heads_path
from .layers import as_hw, count_parameters, in_float32, linear_default_attrs
from .linear import Linear
from .linear_relu6 import linear_relu6, takes_linear_relu6_path
from .permute import permute
from .residual import add_to_every_sample, residual_add, takes_residual_path
from .rows import LayerNorm, softmax_last
from .recompute import run_blocks
from ..process import cpu_setup
from ..kernels.cpu_kernels import as_numpy

__all__ = ["VisionTransformer", "VIT_OPTIONS", "DropPath", "Attention", "Mlp", "Block",
           "PatchEmbed"]

# Constructor settings only the ViTs have (Model.* keys that other backbones refuse).
VIT_OPTIONS = ("drop_path_rate", "mask_ratio", "patch_size", "recompute")

INIT_STD = 0.02  # timm's trunc_normal_(std=.02) for Linear weights and pos_embed; normal for mask_token
LN_EPS = 1e-5    # torch.nn.LayerNorm's default
BN_EPS = 2e-5    # the feature head's BatchNorm1d(eps=2e-5)
BN_MOMENTUM = 0.9  # torch's default momentum 0.1 (weight of the new batch) in Paddle's convention


def _trunc_normal():
    # timm's trunc_normal_ cuts at a = -2, b = 2 in absolute value, as Paddle's TruncatedNormal
    # does: with std 0.02 that is 100 standard deviations.
    return paddle.ParamAttr(initializer=nn.initializer.TruncatedNormal(0.0, INIT_STD, -2.0, 2.0))


def _linear(in_features, out_features, bias=True):
    """arcface_torch's `_init_weights`: weight trunc-normal(0.02), bias 0."""
    bias_attr = paddle.ParamAttr(initializer=nn.initializer.Constant(0.0)) if bias else False
    return Linear(in_features, out_features, weight_attr=_trunc_normal(), bias_attr=bias_attr)


def _layer_norm(dim):
    return LayerNorm(dim, epsilon=LN_EPS)  # weight 1, bias 0


def _batch_norm(num_features):
    return BatchNorm1D(num_features, momentum=BN_MOMENTUM, epsilon=BN_EPS)


class DropPath(nn.Layer):
    """Stochastic depth (timm's DropPath): in training, a sample's whole branch is zeroed with
    probability `p`, else scaled by 1/(1 − p); the identity in eval or when p = 0."""

    def __init__(self, p=0.0):
        super().__init__()
        self.p = float(p)

    def _draw(self, x):
        """One uniform draw per sample, `[B, 1, ...]`: the branch is kept where it is < 1 − p."""
        return paddle.rand([x.shape[0]] + [1] * (x.ndim - 1), dtype="float32")

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = (self._draw(x) < keep).astype(x.dtype)
        if keep > 0.0:
            mask = mask / keep
        return x * mask

    def residual(self, x, branch):
        """x + self(branch); one PyLayer on the CPU kernel set (`plsc.models.residual`), the
        same draws and factors (float32 1/keep, as Paddle's scale makes it)."""
        if not takes_residual_path(x, branch):
            return x + self(branch)
        if not self.training or self.p == 0.0:
            return residual_add(x, branch)
        keep = 1.0 - self.p
        factor = (as_numpy(self._draw(x)).reshape(-1) < keep).astype(np.float32)
        if keep > 0.0:
            factor *= np.float32(1.0 / keep)
        return residual_add(x, branch, factor)

    def extra_repr(self):
        return f"p={self.p}"


class Attention(nn.Layer):
    """Multi-head self-attention; scores, softmax and the weighted sum in float32.

    `qkv` (no bias) is `[D, 3D]` in Paddle; its outputs are q, k, v one after the other, each
    split into heads of D/heads contiguous columns (torch's reshape(B, L, 3, heads, D/heads)).
    """

    def __init__(self, dim, num_heads=8, qkv_bias=False, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = int(num_heads)
        self.head_dim = dim // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = _linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = _linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        dim = self.num_heads * self.head_dim
        qkv = self.qkv(x)
        with paddle.amp.auto_cast(enable=False):  # arcface_torch: autocast(False) and .float()
            if takes_heads_path(qkv):  # q comes scaled: the scores need no pass of their own
                q, k, v = split_heads(qkv, self.num_heads, self.scale)
                scores = paddle.matmul(q, k, transpose_y=True)
            else:
                # [B, L, 3D] -> [3, B, heads, L, D/heads]; 0 keeps B and L as they are
                qkv = permute(qkv.reshape([0, 0, 3, self.num_heads, self.head_dim]),
                              [2, 0, 3, 1, 4])
                q, k, v = (t if t.dtype == paddle.float32 else t.astype("float32")
                           for t in paddle.unbind(qkv, axis=0))  # one stack in the backward
                scores = paddle.matmul(q, k, transpose_y=True) * self.scale
            attn = self.attn_drop(softmax_last(scores))
            out = permute(paddle.matmul(attn, v), [0, 2, 1, 3]).reshape([0, 0, dim])
        return self.proj_drop(self.proj(out.astype(x.dtype)))


class Mlp(nn.Layer):
    """fc1 -> ReLU6 -> dropout -> fc2 -> dropout."""

    def __init__(self, dim, hidden, drop=0.0):
        super().__init__()
        self.fc1 = _linear(dim, hidden)
        self.act = nn.ReLU6()
        self.fc2 = _linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        if ((self.drop.p == 0.0 or not self.training) and isinstance(self.act, nn.ReLU6)
                and takes_linear_relu6_path(x, self.fc1.weight)):
            # fc1 and ReLU6 as one PyLayer (`plsc.models.linear_relu6`); no dropout to apply
            return self.fc2(linear_relu6(x, self.fc1.weight, self.fc1.bias))
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Block(nn.Layer):
    """Pre-norm transformer block; one DropPath (one draw per call) serves both branches."""

    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, drop=0.0, attn_drop=0.0,
                 drop_path=0.0):
        super().__init__()
        self.norm1 = _layer_norm(dim)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                              proj_drop=drop)
        self.drop_path = DropPath(drop_path)
        self.norm2 = _layer_norm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)

    def forward(self, x):
        x = self.drop_path.residual(x, self.attn(self.norm1(x)))
        return self.drop_path.residual(x, self.mlp(self.norm2(x)))


class PatchEmbed(nn.Layer):
    """Non-overlapping patches -> tokens `[B, (H//p)·(W//p), D]`, row by row.

    The conv keeps torch's default init (arcface_torch's `_init_weights` skips convs):
    weight and bias U(±1/sqrt(3·p·p))."""

    def __init__(self, input_size, patch_size, embed_dim, in_channels=3):
        super().__init__()
        self.input_size = as_hw(input_size)
        self.patch_size = int(patch_size)
        if not 1 <= self.patch_size <= min(self.input_size):
            raise ValueError(f"patch_size must be in [1, {min(self.input_size)}] for input_size "
                             f"{self.input_size}, got {patch_size!r}")
        self.grid = tuple(n // self.patch_size for n in self.input_size)
        self.num_patches = self.grid[0] * self.grid[1]
        weight_attr, bias_attr = linear_default_attrs(in_channels * self.patch_size ** 2)
        self.proj = Conv2D(in_channels, embed_dim, self.patch_size, stride=self.patch_size,
                           weight_attr=weight_attr, bias_attr=bias_attr)

    def forward(self, x):
        height, width = x.shape[2], x.shape[3]
        if (height, width) != self.input_size and min(height, width) > 0:
            raise ValueError(f"input images are {height}x{width}, the model was built for "
                             f"{self.input_size[0]}x{self.input_size[1]} (input_size)")
        return permute(self.proj(x).flatten(2), [0, 2, 1])


class VisionTransformer(nn.Layer):
    """Face ViT: images `[B, 3, H, W]` -> embeddings `[B, embedding_size]`.

    Args:
        embedding_size: output feature size (arcface_torch's `num_classes`/`num_features`).
        input_size: `(H, W)` (or one int); with `patch_size` it fixes the token count
            L = (H//p)·(W//p) and so `pos_embed` and the first feature Linear.
        dropout: arcface_torch's `drop_rate` (its `get_model` leaves it 0): dropout after the
            position embedding, in the MLP (after the activation and after fc2) and after the
            attention projection.
        embed_dim, depth, num_heads, mlp_ratio, qkv_bias: the transformer's width D, block
            count, heads (D divisible by it), MLP width ratio, bias of qkv.
        patch_size: patch side in pixels (square patches, stride = patch).
        drop_path_rate: stochastic depth of the last block; block i of n has
            `drop_path_rate · i/(n − 1)`.
        mask_ratio: in training, each sample keeps `int(L·(1 − mask_ratio))` tokens chosen at
            random through the blocks, and the others are the learned `mask_token` after the
            final norm. This is the ratio used: arcface_torch ignores its value and masks 10 %
            whenever it is > 0.
        attn_dropout: dropout on the attention weights (arcface_torch's `attn_drop_rate`).
        recompute: in training, recompute each transformer block's activations in the backward
            instead of keeping them (arcface_torch's `using_checkpoint`; `plsc.models.recompute`:
            the same results, BatchNorm statistics and random draws included).

    Each block is a sublayer of the `blocks` LayerList, called one after the other.
    """

    def __init__(self, embedding_size=512, input_size=(112, 112), dropout=0.0, embed_dim=768,
                 depth=12, num_heads=8, patch_size=9, mlp_ratio=4.0, qkv_bias=False,
                 drop_path_rate=0.0, mask_ratio=0.0, attn_dropout=0.0, recompute=False):
        super().__init__()
        cpu_setup.ensure()  # a run's CPU set-up (threads, malloc) unless the user chose
        self.recompute = bool(recompute)
        for name, value in (("dropout", dropout), ("attn_dropout", attn_dropout)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if not 0.0 <= drop_path_rate <= 1.0:
            raise ValueError(f"drop_path_rate must be in [0, 1], got {drop_path_rate!r}")
        if int(depth) < 1:
            raise ValueError(f"depth must be at least 1, got {depth!r}")
        self.embedding_size = int(embedding_size)
        self.input_size = as_hw(input_size)
        self.embed_dim = int(embed_dim)
        self.depth = int(depth)
        self.num_heads = int(num_heads)
        self.drop_path_rate = float(drop_path_rate)
        self.mask_ratio = float(mask_ratio)

        self.patch_embed = PatchEmbed(self.input_size, patch_size, self.embed_dim)
        self.patch_size = self.patch_embed.patch_size
        self.num_patches = self.patch_embed.num_patches
        self.tokens_kept = int(self.num_patches * (1 - self.mask_ratio))  # arcface_torch's len_keep
        if not (0.0 <= self.mask_ratio < 1.0 and self.tokens_kept >= 1):
            raise ValueError(f"mask_ratio must be in [0, 1) and keep at least one of the "
                             f"{self.num_patches} tokens, got {mask_ratio!r}")

        self.pos_embed = self.create_parameter(
            [1, self.num_patches, self.embed_dim],
            default_initializer=nn.initializer.TruncatedNormal(0.0, INIT_STD, -2.0, 2.0))
        self.pos_drop = nn.Dropout(dropout)
        rates = [self.drop_path_rate * i / (self.depth - 1) if self.depth > 1 else 0.0
                 for i in range(self.depth)]  # torch.linspace(0, drop_path_rate, depth)
        self.blocks = nn.LayerList([
            Block(self.embed_dim, self.num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                  drop=dropout, attn_drop=attn_dropout, drop_path=rate) for rate in rates])
        self.norm = _layer_norm(self.embed_dim)
        self.feature = nn.Sequential(
            _linear(self.embed_dim * self.num_patches, self.embed_dim, bias=False),
            _batch_norm(self.embed_dim),
            _linear(self.embed_dim, self.embedding_size, bias=False),
            _batch_norm(self.embedding_size),
        )
        self.mask_token = self.create_parameter(
            [1, 1, self.embed_dim], default_initializer=nn.initializer.Normal(0.0, INIT_STD))

    def random_masking(self, x):
        """(the `tokens_kept` tokens of each sample chosen by sorting uniform noise, in noise
        order; `ids_restore`, the permutation that puts them back)."""
        batch, length, _ = x.shape
        noise = paddle.rand([batch, length], dtype="float32")
        ids_shuffle = paddle.argsort(noise, axis=1)  # ascending: the smallest noise is kept
        ids_restore = paddle.argsort(ids_shuffle, axis=1)
        ids_keep = ids_shuffle[:, :self.tokens_kept]
        kept = take_rows_per_sample(x, ids_keep)
        return kept, ids_restore

    def unmask(self, x, ids_restore):
        """The kept tokens back in place, the learned mask token everywhere else."""
        batch, kept, dim = x.shape
        fill = self.mask_token.astype(x.dtype).expand([batch, self.num_patches - kept, dim])
        full = paddle.concat([x, fill], axis=1)
        return take_rows_per_sample(full, ids_restore)

    def forward_features(self, x):
        """Images -> the flattened tokens `[B, L·D]` after the final norm."""
        x = self.pos_drop(add_to_every_sample(self.patch_embed(x), self.pos_embed))
        masking = self.training and self.mask_ratio > 0
        if masking:
            x, ids_restore = self.random_masking(x)
        x = run_blocks(self.blocks, x, self.recompute and self.training)
        x = self.norm(x.astype("float32"))
        if masking:
            x = self.unmask(x, ids_restore)
        return x.flatten(1)

    def forward(self, x):
        # the feature head in float32 under AMP: arcface_torch runs it outside autocast
        return in_float32(self.feature, self.forward_features(x))

    def num_parameters(self, trainable_only=False):
        """Weight count, without BatchNorm running statistics."""
        return count_parameters(self, trainable_only)


def _named_vit(name, embed_dim, depth, drop_path_rate, mask_ratio, patch_size=9, recompute=False,
               doc=""):
    defaults = {"embed_dim": embed_dim, "depth": depth, "num_heads": 8, "patch_size": patch_size,
                "drop_path_rate": drop_path_rate, "mask_ratio": mask_ratio,
                "recompute": recompute}

    def build(**kwargs):
        for key, value in defaults.items():
            if kwargs.get(key) is None:  # None: the name's value
                kwargs[key] = value
        return VisionTransformer(**kwargs)
    build.__name__ = name
    build.__doc__ = (f"{doc}D = {embed_dim}, depth {depth}, 8 heads, patch {patch_size}, drop "
                     f"path {drop_path_rate}, mask ratio {mask_ratio}, recompute {recompute}; "
                     "keyword args as "
                     "`VisionTransformer` (None: this value).")
    build.options = VIT_OPTIONS
    build.defaults = dict(defaults)
    return build


# arcface_torch's get_model (num_heads 8, patch 9 at 112x112 for all; the B, L and H models with
# using_checkpoint=True: recompute).
vit_t = _named_vit("vit_t", 256, 12, 0.1, 0.1)
vit_t_dp005_mask0 = _named_vit("vit_t_dp005_mask0", 256, 12, 0.05, 0.0)
vit_s = _named_vit("vit_s", 512, 12, 0.1, 0.1)
vit_s_dp005_mask0 = _named_vit("vit_s_dp005_mask0", 512, 12, 0.05, 0.0)
vit_b = _named_vit("vit_b", 512, 24, 0.1, 0.1, recompute=True)
vit_b_dp005_mask005 = _named_vit("vit_b_dp005_mask005", 512, 24, 0.05, 0.05, recompute=True)
vit_l_dp005_mask005 = _named_vit("vit_l_dp005_mask005", 768, 24, 0.05, 0.05, recompute=True)
vit_h = _named_vit("vit_h", 1024, 48, 0.1, 0.0, recompute=True)
# Not in arcface_torch: a small ViT for CPU demos (56x56 with patch 7: 64 tokens).
vit_demo = _named_vit("vit_demo", 128, 4, 0.05, 0.0, patch_size=8,
                      doc="A small ViT for CPU demos (56x56 images: 7x7 tokens): ")
