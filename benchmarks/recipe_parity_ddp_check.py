"""Check of `recipe_parity_torch.py --ranks 2`'s emulation against arcface_torch on 2 real ranks.

    /path/to/torch/venv/bin/python benchmarks/recipe_parity_ddp_check.py \\
        --arcface-torch /path/to/insightface/recognition/arcface_torch \\
        --work /tmp/rp2/iresnet18_arcface --case iresnet18_arcface --steps 3

Run by a torch interpreter (like `recipe_parity_torch.py`, never by plsc or its tests) on the
files a `--ranks 2` torch run wrote in --work (initial weights, batches). It trains `--steps`
steps in float64 twice: on 2 gloo processes as `train_v2.py` does (the backbone in
`DistributedDataParallel(broadcast_buffers=False, find_unused_parameters=True)`, `PartialFC_V2`
of world 2, each rank on its half of every batch, clip 5, one optimizer, `PolynomialLRWarmup`),
without the fp16 compression hook; and with the emulation (`recipe_parity_torch.train(...,
ranks=2)`, one process). It prints one JSON line: both ranks' losses and the emulation's, the
relative L2 distances of the head (both ranks' shards), of rank 0's backbone and of its
BatchNorm statistics to the emulation's, and rank 1's statistics' (which differ: per rank).
"""
import argparse
import json
import os
import socket
import sys

import numpy as np
import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import recipe_parity_torch as rpt  # noqa: E402

DTYPE = torch.float64


def _load(work):
    return (torch.load(os.path.join(work, "init_backbone.pt")),
            np.load(os.path.join(work, "init_head.npy")),
            np.load(os.path.join(work, "images.npy")), np.load(os.path.join(work, "labels.npy")))


def rank_main(rank, port, args):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=2)
    sys.path.insert(0, os.path.abspath(args.arcface_torch))
    rpt.shims()
    from lr_scheduler import PolynomialLRWarmup
    network, margin_list, opt_name, lr, wd, num_classes = rpt.CASES[args.case]
    torch.set_default_dtype(DTYPE)
    float_method = torch.Tensor.float  # the ViT's .float() keeps float64 (as `rpt.train` does)
    torch.Tensor.float = lambda self, *a, **k: (self if self.dtype == torch.float64
                                                 else float_method(self, *a, **k))
    init_b, init_h, images, labels = _load(args.work)
    backbone = rpt.build_backbone(network)
    backbone.load_state_dict(init_b)
    backbone = torch.nn.parallel.DistributedDataParallel(  # train_v2.py's, on the CPU
        module=backbone, broadcast_buffers=False, find_unused_parameters=True)
    head = rpt.build_head(margin_list, num_classes)
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(
            init_h[head.class_start:head.class_start + head.num_local]))
    backbone.train()
    head.train()
    groups = [{"params": backbone.parameters()}, {"params": head.parameters()}]
    opt = (torch.optim.SGD(params=groups, lr=lr, momentum=0.9, weight_decay=wd)
           if opt_name == "sgd" else torch.optim.AdamW(params=groups, lr=lr, weight_decay=wd))
    sched = PolynomialLRWarmup(optimizer=opt, warmup_iters=args.warmup, total_iters=args.total)
    half = images.shape[1] // 2
    losses = []
    for step in range(args.steps):
        img = torch.from_numpy(images[step][rank * half:(rank + 1) * half]).to(DTYPE)
        lab = torch.from_numpy(labels[step][rank * half:(rank + 1) * half]).long()
        loss = head(backbone(img), lab)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(backbone.parameters(), rpt.CLIP)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(float(loss))
    final = {k: v.detach().numpy() for k, v in backbone.module.state_dict().items()}
    np.savez(os.path.join(args.out, f"ddp_rank{rank}.npz"), losses=np.array(losses),
             head=head.weight.detach().numpy(), **{"bb." + k: v for k, v in final.items()})
    torch.distributed.destroy_process_group()


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arcface-torch", required=True)
    ap.add_argument("--work", required=True, help="a --ranks 2 torch run's folder (one case)")
    ap.add_argument("--case", required=True, choices=sorted(rpt.CASES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--total", type=int, default=20)
    ap.add_argument("--out", help="default: --work")
    args = ap.parse_args()
    args.out = args.out or args.work
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, args), nprocs=2, join=True)
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.abspath(args.arcface_torch))
    rpt.shims()
    init_b, init_h, images, labels = _load(args.work)
    losses, _, _, final = rpt.train(args.case, init_b, torch.from_numpy(init_h), images, labels,
                                    args.steps, DTYPE, args.warmup, args.total, ranks=2)
    r0, r1 = (np.load(os.path.join(args.out, f"ddp_rank{r}.npz")) for r in (0, 1))
    keys = [k for k in final if k != "head.weight" and final[k].dtype.kind == "f"]
    stats = [k for k in keys if k.endswith(("running_mean", "running_var"))]

    def flat(src, ks, prefix=""):
        return np.concatenate([np.asarray(src[prefix + k]).ravel() for k in ks])

    report = {"case": args.case, "steps": args.steps, "dtype": "float64",
              "loss_ddp_rank0": r0["losses"].tolist(), "loss_ddp_rank1": r1["losses"].tolist(),
              "loss_emulated": losses,
              "head_rel_l2": _rel(np.concatenate([r0["head"], r1["head"]]), final["head.weight"]),
              "backbone_rank0_rel_l2": _rel(flat(r0, keys, "bb."), flat(final, keys))}
    if stats:
        report["bn_stats_rank0_rel_l2"] = _rel(flat(r0, stats, "bb."), flat(final, stats))
        report["bn_stats_rank1_rel_l2"] = _rel(flat(r1, stats, "bb."), flat(final, stats))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
