"""A peer's head, counted from its code: arcface_torch's Partial FC on a GPU rank, so that the
planner can be checked against the peer's own published memory table (docs/scaling.md).

Two versions of arcface_torch (deepinsight/insightface, recognition/arcface_torch):

- "v1": `partial_fc.py` and `train.py` of commit c0b95cc6 (2021-07-22, "added speed
  benchmark"), the code that measured the README's table of memory per GPU (8 x V100 32 GB,
  IResNet50, 128 a GPU, fp16 backbone, SGD momentum 0.9, weight decay 5e-4, PyTorch 1.6-1.8).
  The shard's centres and their momentum are plain float32 tensors; each step copies the
  sampled rows into a new Parameter (`weight[index]`) and their momentum (`weight_mom[index]`),
  and the head's forward/backward runs in float32.
- "v2": `partial_fc_v2.py` (`PartialFC_V2`, 2022 on): the shard's centres are one Parameter,
  sampled by indexing, so its gradient is a dense float32 tensor of the whole shard, and the
  optimizer (`torch.optim.SGD` with momentum, or AdamW) keeps state for the whole shard.

Each array is named with the line that makes it; sizes are in elements of float32 (4 bytes).
`C`: classes of the rank, `S = int(rate * C)`: sampled classes, `N`: gathered batch, `d`: the
embedding. Only the terms that grow with the classes or the batch are the head's; the backbone
is the planner's own (`plan.backbone`, `plan.measured`).
"""
__all__ = ["VERSIONS", "head_phases", "head_peak", "per_class_bytes"]

VERSIONS = ("v1", "v2")
_F32 = 4


def _v1(C, S, N, d, rows_hit):
    """arcface_torch v1 (partial_fc.py at c0b95cc6), its two largest moments."""
    arrays = {"weight [C, d]": C * d, "weight_mom [C, d]": C * d}
    sampled = {"sub_weight = Parameter(weight[index]) [S, d]": S * d,
               "sub_weight_mom = weight_mom[index] [S, d]": S * d}
    # (a) the margin's backward (logits.backward(grad)), AcosBackward running; alive:
    # `logits` (ArcFace's acos_, cos_, mul_ all in place on it), the clones autograd saves for
    # the in-place acos_ and cos_ (their derivatives read their input), `grad` (= logits_exp,
    # still named in forward_backward), the incoming gradient and the six temporaries of
    # acos's derivative `grad * -((-self * self + 1).rsqrt())` (one C++ full expression);
    # norm_weight = normalize(sub_weight), saved by linear for its backward.
    backward = dict(arrays, **sampled)
    backward["norm_weight (saved by linear) [S, d]"] = S * d
    backward["logits, acos_ clone, logits_exp, incoming grad [N, S] x 4"] = 4 * N * S
    backward["acos backward temporaries [N, S] x 6"] = 6 * N * S
    backward["margin one-hot and grad[index] [rows, S] x 2"] = 2 * rows_hit * S
    # (b) opt_pfc.step() on sub_weight: its gradient and SGD's weight-decay temporary
    # (torch.optim SGD: d_p = d_p.add(p, alpha=weight_decay), a new tensor); the logits freed.
    step = dict(arrays, **sampled)
    step["sub_weight.grad [S, d]"] = S * d
    step["SGD weight-decay temporary [S, d]"] = S * d
    return {"backward": backward, "step": step}


def _v2(C, S, N, d, optimizer):
    """arcface_torch v2 (PartialFC_V2 with train_v2.py's optimizer), its optimizer step: the
    logits are freed, the shard's dense gradient is alive (backward's `index` of the Parameter
    scatters into a `[C, d]` gradient)."""
    step = {"weight (Parameter) [C, d]": C * d, "weight.grad (dense) [C, d]": C * d}
    if optimizer == "sgd":
        step["momentum_buffer [C, d]"] = C * d
        # single-tensor SGD: d_p = d_p.add(param, alpha=wd); foreach SGD:
        # grads = torch._foreach_add(grads, params, alpha=wd): a new tensor either way
        step["SGD weight-decay temporary [C, d]"] = C * d
    elif optimizer == "adamw":
        step["exp_avg [C, d]"] = C * d
        step["exp_avg_sq [C, d]"] = C * d
        # AdamW: denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps), or
        # torch._foreach_sqrt(exp_avg_sqs) on the foreach path: a new tensor either way
        step["AdamW sqrt(exp_avg_sq) temporary [C, d]"] = C * d
    else:
        raise ValueError(f"optimizer {optimizer!r}: sgd or adamw")
    return {"step": step}


def head_phases(version, num_local, d, sample_rate, n, world, optimizer="sgd"):
    """{phase: {array: bytes}} of arcface_torch's head on a rank of `num_local` classes
    (`n`: the gathered batch, `world`: ranks; the rows of the batch whose label this rank owns
    are n / world, uniformly spread labels)."""
    C = int(num_local)
    S = int(sample_rate * C) if sample_rate < 1 else C
    if version == "v1":
        if optimizer != "sgd":
            raise ValueError("arcface_torch v1 trains with SGD only")
        phases = _v1(C, S, n, d, -(-n // world))
    elif version == "v2":
        phases = _v2(C, S, n, d, optimizer)
    else:
        raise ValueError(f"version {version!r}: one of {', '.join(VERSIONS)}")
    return {p: {k: _F32 * v for k, v in arrays.items()} for p, arrays in phases.items()}


def head_peak(version, num_local, d, sample_rate, n, world, optimizer="sgd"):
    """(phase, {array: bytes}) of the phase holding the most bytes."""
    phases = head_phases(version, num_local, d, sample_rate, n, world, optimizer)
    return max(phases.items(), key=lambda kv: sum(kv[1].values()))


def per_class_bytes(version, d, sample_rate, n, world, optimizer="sgd", classes=10 ** 6):
    """Bytes per class of the rank at its peak phase (the slope at `classes` a rank)."""
    a = sum(head_peak(version, classes, d, sample_rate, n, world, optimizer)[1].values())
    b = sum(head_peak(version, 2 * classes, d, sample_rate, n, world, optimizer)[1].values())
    return (b - a) / classes
