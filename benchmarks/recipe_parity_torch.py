"""The torch side of `benchmarks/recipe_parity.py`: run by a torch interpreter with an
arcface_torch checkout, never imported by plsc, its tests or CI.

It builds the case's backbone (`backbones.get_model`, or arcface_torch's `VisionTransformer`
with ViT-T's arguments) and `PartialFC_V2` with `CombinedMarginLoss` from the checkout with a
seed, and trains them as `train_v2.py` does on one process (fp16 off): forward, head loss,
`loss.backward()`, `clip_grad_norm_(backbone.parameters(), 5)`, the optimizer over the
backbone's and the head's parameters (SGD momentum 0.9 or AdamW), `PolynomialLRWarmup.step()`.
It does so twice from the same initial weights on the same batches: in float32 and in float64
(`torch.set_default_dtype(torch.float64)`, the model and the inputs double). A third run,
t32x, is float32 with one change, the clip's global norm summed in float64 (`exact_clip`):
torch's own float32 norm is the largest float32 error of the step, and t32x shows the rest.

Partial FC below 1 (`wf42m_vit_t_pfc03`): `--stage prepare` writes the weights and batches only;
`--stage train --sampled FILE` then runs with each step's centres taken from FILE (plsc's draw,
`replay_sampling`) and the head updated by torch's AdamW with the unsampled rows skipped
(`SampledRowsAdamW`, as plsc's SparseAdamW), plus a fourth run, t32r: float32 with
`train_v2.py`'s one AdamW over every centre, the recipe.

With `--ranks 2`, each run is `train_v2.py` on 2 ranks emulated in one process (each half of
a batch through the backbone separately, rank 0's BatchNorm statistics kept; see
`two_rank_embeddings`).

Writes into --out: `init_backbone.pt` (torch.save of the initial state_dict, what plsc imports),
`init_head.npy`, `images.npy` `[steps, B, 3, 112, 112]` float32, `labels.npy` `[steps, B]`,
`final_{t32,t64,t32x[,t32r]}.npz` (the final backbone state_dict in arcface_torch's keys,
`head.weight`), and `torch.json` (per-step losses, learning rates, pre-clip gradient norms, versions).

Compatibility shims (they change no arithmetic), all applied here and not in the checkout:
- torch >= 2.6's `LRScheduler.__init__` has no `verbose` argument, which `PolynomialLRWarmup`
  passes: it is dropped.
- `PartialFC_V2` calls `.cuda()`: on this CPU-only run `Tensor.cuda` returns the tensor itself.
- It asserts an initialised process group: a gloo group of one process.
- float64 run only: arcface_torch's ViT calls `.float()` on its activations (q, k, v and the
  final norm's input), which would drop the float64 run to float32 there; `Tensor.float`
  returns a float64 tensor unchanged during that run.
"""
import argparse
import copy
import json
import math
import os
import socket
import sys

import numpy as np
import torch

CASES = {
    # name: (network, margin_list (m1, m2, m3), optimizer, lr, weight_decay, num_classes,
    #        sample_rate)
    "iresnet18_arcface": ("r18", (1.0, 0.5, 0.0), "sgd", 0.1, 5e-4, 100, 1.0),
    "iresnet50_cosface_pfc": ("r50", (1.0, 0.0, 0.4), "sgd", 0.1, 5e-4, 200, 1.0),
    "vit_t_adamw": ("vit_t", (1.0, 0.0, 0.4), "adamw", 1e-3, 0.1, 100, 1.0),
    "arcface_r50": ("r50", (1.0, 0.5, 0.0), "sgd", 0.1, 5e-4, 100, 1.0),
    "cosface_r100": ("r100", (1.0, 0.0, 0.4), "sgd", 0.1, 5e-4, 100, 1.0),
    "wf42m_vit_t_pfc03": ("vit_t", (1.0, 0.0, 0.4), "adamw", 1e-3, 0.1, 100, 0.3),
}
SCALE = 64.0  # train_v2.py: CombinedMarginLoss(64, *margin_list, ...)
EMBEDDING = 512
CLIP = 5.0  # train_v2.py: clip_grad_norm_(backbone.parameters(), 5)


def shims():
    from torch.optim import lr_scheduler
    init = lr_scheduler.LRScheduler.__init__

    def no_verbose(self, optimizer, last_epoch=-1, verbose=None):
        init(self, optimizer, last_epoch)

    lr_scheduler.LRScheduler.__init__ = no_verbose
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                             rank=0, world_size=1)


def build_backbone(network):
    from backbones import get_model
    if network == "vit_t":
        # get_model("vit_t")'s arguments, with stochastic depth and masking off: their random
        # draws come from torch's generator and cannot be replayed in Paddle.
        from backbones.vit import VisionTransformer
        return VisionTransformer(img_size=112, patch_size=9, num_classes=EMBEDDING, embed_dim=256,
                                 depth=12, num_heads=8, drop_path_rate=0.0, norm_layer="ln",
                                 mask_ratio=0.0)
    return get_model(network, dropout=0.0, fp16=False, num_features=EMBEDDING)


def build_head(margin_list, num_classes, sample_rate):
    from losses import CombinedMarginLoss
    from partial_fc_v2 import PartialFC_V2
    margin = CombinedMarginLoss(SCALE, *margin_list, 0)
    return PartialFC_V2(margin, EMBEDDING, num_classes, sample_rate, False)


def replay_sampling(head, sampled):
    """`head.sample` (PartialFC_V2's, `rand` + `topk` over the centres) replaced by one that
    takes step i's centres from `sampled[i]` (plsc's draw, sorted local indices) and does the
    rest as the checkout's: every positive must be among them, `weight_index` is set, the
    positive labels become positions in the index (`searchsorted`), the rows are gathered."""
    steps = iter(sampled)

    def sample(labels, index_positive):
        with torch.no_grad():
            index = torch.from_numpy(next(steps)).long()
            positive = torch.unique(labels[index_positive], sorted=True)
            if index.numel() != head.num_sample or not torch.isin(positive, index).all():
                raise RuntimeError(f"the replayed centres ({index.numel()}) are not a draw of "
                                   f"PartialFC_V2's ({head.num_sample}, every positive)")
            head.weight_index = index
            labels[index_positive] = torch.searchsorted(index, labels[index_positive])
        return head.weight[head.weight_index]

    head.sample = sample


class SampledRowsAdamW:
    """torch's `AdamW` on the head's centres with the update of unsampled rows skipped, as
    plsc's `SparseAdamW` does: every row is its own parameter of one `torch.optim.AdamW`, and
    a step gives a gradient only to the rows sampled in it. torch's optimizers skip a parameter
    whose `.grad` is None (no moment update, no decay, no step count), so an unsampled row keeps
    its value and state and each row's bias correction counts the steps it was sampled in
    (plsc's per-row step count). The arithmetic on a sampled row is torch's AdamW's."""

    def __init__(self, weight, lr, weight_decay):
        self.weight = weight
        self.rows = [torch.nn.Parameter(weight.detach()[r].clone()) for r in range(len(weight))]
        self.opt = torch.optim.AdamW(self.rows, lr=lr, weight_decay=weight_decay)

    def step(self, lr, index):
        grad = self.weight.grad
        for r in index.tolist():
            self.rows[r].grad = grad[r].clone()
        self.opt.param_groups[0]["lr"] = lr
        self.opt.step()
        with torch.no_grad():
            self.weight.copy_(torch.stack([p.detach() for p in self.rows]))
        self.weight.grad = None
        for p in self.rows:
            p.grad = None


def exact_clip(parameters, max_norm):
    """`clip_grad_norm_`'s scaling with the global norm summed in float64: torch's float32
    `vector_norm` on the CPU (what `clip_grad_norm_` uses) is off by about 4e-4 of the norm on a
    12.8M-element tensor (IResNet's fc.weight), which rescales every clipped update by as much."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = math.sqrt(sum(float(torch.sum(g.double() * g.double())) for g in grads))
    coef = min(1.0, max_norm / (total + 1e-6))
    for g in grads:
        g.mul_(coef)
    return total


def two_rank_embeddings(backbone, img):
    """What arcface_torch's `train_v2.py` computes on 2 ranks (DDP, no SyncBatchNorm), in one
    process: rank r's backbone forward on its half img[r·B/2 : (r+1)·B/2] in train mode (so
    BatchNorm normalises with that half's statistics), the embeddings concatenated in rank order
    (what `PartialFC_V2`'s `AllGather` + `torch.cat` gives every rank), and the BatchNorm running
    statistics rank 0 ends with. The one backward of the world-1 `PartialFC_V2` on the whole
    batch through this then gives DDP's gradients, from the checkout's lines:
    - partial_fc_v2.py `PartialFC_V2.forward`: `_list_embeddings = AllGather(local_embeddings,
      ...)`, `embeddings = torch.cat(_list_embeddings)`, labels all-gathered likewise; the loss
      (`DistCrossEntropyFunc`, max/sum/loss all-reduced) is the mean over the gathered batch, the
      same value on every rank; its backward divides the logits' gradient by that batch.
    - partial_fc_v2.py `AllGatherFunc.backward`: each rank's slice of the gathered embeddings'
      gradient is summed over the ranks (`distributed.reduce(..., ReduceOp.SUM)`: every rank
      holds the gradient through its own class shard only, the sum is the whole gradient of the
      loss), then `grad_out *= len(grad_list)` (× world size).
    - train_v2.py: `DistributedDataParallel(module=backbone, broadcast_buffers=False, ...,
      find_unused_parameters=True)`: DDP averages the backbone's gradients (÷ world size), which
      undoes the × world size: each rank's backbone gradient is the whole batch's gradient of
      the loss, what one backward through both halves here gives. The head (`PartialFC_V2`) is
      not in DDP: each rank's centres get the whole gradient of the loss for its classes, as the
      world-1 head here does for all classes. `clip_grad_norm_(backbone.parameters(), 5)` then
      acts on the averaged gradients, as here.
    - train_v2.py also registers `fp16_compress_hook` (the gradients all-reduced in float16):
      not emulated here, and plsc's `Optimizer.grad_allreduce_dtype` is left at float32 (issue
      46 item 5 is about that option; this comparison is of the float32 arithmetic).
    - BatchNorm running statistics: `broadcast_buffers=False` in this checkout (not DDP's
      default True), so each rank's running statistics follow its own halves only, and rank 0
      saves the checkpoint (`if rank == 0: ... torch.save(backbone.module.state_dict(), ...)`).
      With DDP's default (broadcast from rank 0 before each forward) rank 0's would be the same:
      the broadcast overwrites the other ranks' buffers, never rank 0's, and in train mode the
      forward uses batch statistics, not the buffers. So: after the first half's forward (rank
      0's update) the buffers are set aside, the second half runs on copies of them (rank 1's),
      and rank 0's are put back. Swapped as objects, not copied in place: the first forward's
      graph holds the buffers, and an in-place change would fail its backward's version check.
    """
    half = img.shape[0] // 2
    first = backbone(img[:half])
    rank0 = [(m, k, b) for m in backbone.modules() for k, b in m._buffers.items()
             if b is not None]
    for m, k, b in rank0:
        m._buffers[k] = b.detach().clone()
    second = backbone(img[half:])
    for m, k, b in rank0:
        m._buffers[k] = b
    return torch.cat([first, second])


def train(case, init_backbone, init_head, images, labels, steps, dtype, warmup, total,
          exact_norm=False, ranks=1, sampled=None, every_row=False):
    """One run; with `sampled` (Partial FC) the centres of each step are plsc's draw, and the
    head's rows not sampled are skipped by the optimizer (`SampledRowsAdamW`) unless
    `every_row` (train_v2.py's one optimizer over every centre, the recipe)."""
    from lr_scheduler import PolynomialLRWarmup
    network, margin_list, opt_name, lr, wd, num_classes, rate = CASES[case]
    torch.set_default_dtype(dtype)
    float_method = torch.Tensor.float
    if dtype == torch.float64:
        torch.Tensor.float = lambda self, *a, **k: (self if self.dtype == torch.float64
                                                     else float_method(self, *a, **k))
    try:
        backbone = build_backbone(network)
        backbone.load_state_dict(init_backbone)  # copies into the parameters' dtype
        head = build_head(margin_list, num_classes, rate)
        with torch.no_grad():
            head.weight.copy_(init_head)
        backbone.train()
        head.train()
        rows_opt = None
        if rate < 1:
            replay_sampling(head, sampled)
            if not every_row:
                if opt_name != "adamw":
                    raise RuntimeError("sampled rows: AdamW only")
                rows_opt = SampledRowsAdamW(head.weight, lr, wd)
        groups = [{"params": backbone.parameters()}]
        if rows_opt is None:
            groups.append({"params": head.parameters()})
        if opt_name == "sgd":
            opt = torch.optim.SGD(params=groups, lr=lr, momentum=0.9, weight_decay=wd)
        else:
            opt = torch.optim.AdamW(params=groups, lr=lr, weight_decay=wd)
        sched = PolynomialLRWarmup(optimizer=opt, warmup_iters=warmup, total_iters=total)
        losses, lrs, norms = [], [], []
        for step in range(steps):
            lrs.append(opt.param_groups[0]["lr"])
            img = torch.from_numpy(images[step]).to(dtype)
            lab = torch.from_numpy(labels[step]).long()
            emb = backbone(img) if ranks == 1 else two_rank_embeddings(backbone, img)
            loss = head(emb, lab)
            loss.backward()
            if exact_norm:
                norms.append(exact_clip(backbone.parameters(), CLIP))
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_(backbone.parameters(), CLIP)))
            opt.step()
            if rows_opt is not None:
                rows_opt.step(lrs[-1], head.weight_index)
            opt.zero_grad()
            sched.step()
            losses.append(float(loss.item()))
        final = {k: v.detach().cpu().numpy() for k, v in backbone.state_dict().items()}
        final["head.weight"] = head.weight.detach().cpu().numpy()
        return losses, lrs, norms, final
    finally:
        torch.Tensor.float = float_method
        torch.set_default_dtype(torch.float32)


def prepare(args, network, margin_list, num_classes, rate):
    """The initial weights and the batches, written into --out."""
    torch.manual_seed(args.seed)  # arcface_torch's setup_seed does this (and numpy's, random's)
    backbone = build_backbone(network)
    head = build_head(margin_list, num_classes, rate)
    torch.save(copy.deepcopy(backbone.state_dict()), os.path.join(args.out, "init_backbone.pt"))
    np.save(os.path.join(args.out, "init_head.npy"), head.weight.detach().numpy())
    rng = np.random.default_rng(args.seed)
    # Images as train_v2's loader gives them ((x/255 - 0.5)/0.5, so in [-1, 1]), random labels.
    images = rng.uniform(-1.0, 1.0, (args.steps, args.batch, 3, 112, 112)).astype(np.float32)
    labels = rng.integers(0, num_classes, (args.steps, args.batch)).astype(np.int64)
    np.save(os.path.join(args.out, "images.npy"), images)
    np.save(os.path.join(args.out, "labels.npy"), labels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arcface-torch", required=True)
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--total", type=int, default=20)
    ap.add_argument("--seed", type=int, default=2048)  # arcface_torch's configs/base.py seed
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=1, choices=(1, 2),
                    help="2: arcface_torch on 2 ranks (DDP, per-rank BatchNorm), emulated")
    ap.add_argument("--stage", choices=("all", "prepare", "train"), default="all",
                    help="prepare: the initial weights and batches only; train: from them")
    ap.add_argument("--sampled", help="Partial FC: a [steps, num_sample] int64 .npy of each "
                    "step's centres (plsc's draw on the batches written by --stage prepare)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.arcface_torch))
    if args.threads:
        torch.set_num_threads(args.threads)
    shims()
    network, margin_list, opt_name, lr, wd, num_classes, rate = CASES[args.case]
    if args.stage != "train":
        prepare(args, network, margin_list, num_classes, rate)
    if args.stage == "prepare":
        return
    sampled = None
    if rate < 1:
        if not args.sampled or args.ranks != 1:
            raise SystemExit("Partial FC below 1: --sampled, on one rank")
        sampled = np.load(args.sampled)
    init_backbone = torch.load(os.path.join(args.out, "init_backbone.pt"))
    init_head = torch.from_numpy(np.load(os.path.join(args.out, "init_head.npy")))
    images = np.load(os.path.join(args.out, "images.npy"))
    labels = np.load(os.path.join(args.out, "labels.npy"))

    report = {"torch": torch.__version__, "numpy": np.__version__,
              "threads": torch.get_num_threads(), "ranks": args.ranks}
    # t32x: float32 with the clip's norm summed in float64 (a stricter float32 yardstick);
    # t32r (Partial FC only): float32 with train_v2.py's optimizer on every centre (the recipe)
    runs = [("t32", torch.float32, False, False), ("t64", torch.float64, False, False),
            ("t32x", torch.float32, True, False)]
    if rate < 1:
        runs.append(("t32r", torch.float32, False, True))
    for tag, dtype, exact, every_row in runs:
        losses, lrs, norms, final = train(args.case, init_backbone, init_head, images, labels,
                                          args.steps, dtype, args.warmup, args.total, exact,
                                          args.ranks, sampled, every_row)
        np.savez(os.path.join(args.out, f"final_{tag}.npz"), **final)
        report[tag] = {"losses": losses, "lrs": lrs, "grad_norms": norms}
    with open(os.path.join(args.out, "torch.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
