"""The arcface_torch side of `benchmarks/benchmark_train.py`: one rank of train_v2.py's training
loop, started by `torchrun` from a torch interpreter; never imported by plsc, its tests or CI.

Everything is built from the checkout's own modules (imported from --arcface-torch):
`backbones.get_model(network, dropout=0.0, fp16=False, num_features=512)` in
`DistributedDataParallel(broadcast_buffers=False, bucket_cap_mb=16,
find_unused_parameters=True)` over gloo with `fp16_compress_hook` and `_set_static_graph()`,
`losses.CombinedMarginLoss(64, m1, m2, m3, 0)`, `partial_fc_v2.PartialFC_V2(margin, 512,
classes, sample_rate, False)`, SGD (momentum 0.9) or AdamW over the backbone's and the head's
parameters, `lr_scheduler.PolynomialLRWarmup` (no warm-up, over the run's steps),
`utils.utils_distributed_sampler`'s `setup_seed`, `DistributedSampler` and `worker_init_fn`.
The step is train_v2.py's with fp16 off: forward, head loss, backward,
`clip_grad_norm_(backbone.parameters(), 5)`, `opt.step()`, `opt.zero_grad()`,
`lr_scheduler.step()`, `loss.item()`; rank 0 saves the backbone at the epoch's end (not timed).

What differs from train_v2.py, because this runs on the CPU without MXNet:
- the data: dataset.py imports mxnet, so its image-folder branch is rebuilt here with the
  same pieces: torchvision's `ImageFolder` with RandomHorizontalFlip, ToTensor and Normalize
  (0.5, 0.5), in a plain `torch.utils.data.DataLoader` (train_v2's `DataLoaderX` adds a
  prefetching thread that moves batches to a CUDA stream); no pinned memory;
- no logging callback (utils_callbacks imports mxnet through eval.verification), no
  TensorBoard writer, no verification;
- shims that change no arithmetic: torch >= 2.6's `LRScheduler.__init__` has no `verbose`
  (dropped); `Tensor.cuda` returns the tensor (PartialFC_V2 calls it); the sampler's
  `sync_random_seed` broadcasts its seed from a CPU tensor (its default device is "cuda");
  `torch.cuda.set_device` is not called.

Writes `<--out>.rank<r>.json`: per step its wall time, the part spent waiting for the
loader (`data`) and the rank's VmRSS and VmHWM at its end (glibc's retained free blocks make
the peak grow over a run's first tens of steps: docs/performance.md, issue 63); the global
batch, torch's version and threads, and the rank's VmHWM at the end.
"""
import argparse
import json
import os
import sys
import time
from functools import partial


def shims(torch):
    from torch.optim import lr_scheduler
    init = lr_scheduler.LRScheduler.__init__

    def no_verbose(self, optimizer, last_epoch=-1, verbose=None):
        init(self, optimizer, last_epoch)

    lr_scheduler.LRScheduler.__init__ = no_verbose
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    from utils import utils_distributed_sampler
    utils_distributed_sampler.sync_random_seed.__defaults__ = (None, "cpu")


def build_loader(images, batch, workers, rank, world, seed):
    """train_v2's image-folder loader (dataset.py's pieces), on the CPU."""
    import torch
    from torchvision import transforms
    from torchvision.datasets import ImageFolder
    from utils.utils_distributed_sampler import DistributedSampler, worker_init_fn
    transform = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                    transforms.Normalize(mean=[0.5] * 3, std=[0.5] * 3)])
    dataset = ImageFolder(images, transform)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    init_fn = partial(worker_init_fn, num_workers=workers, rank=rank, seed=seed)
    return torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler,
                                       num_workers=workers, drop_last=True,
                                       worker_init_fn=init_fn)


def build_model(spec, steps):
    """(DDP backbone, PartialFC_V2, optimizer, PolynomialLRWarmup) as train_v2.py builds them."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from backbones import get_model
    from losses import CombinedMarginLoss
    from lr_scheduler import PolynomialLRWarmup
    from partial_fc_v2 import PartialFC_V2
    backbone = get_model(spec["torch_network"], dropout=0.0, fp16=False, num_features=512)
    backbone = torch.nn.parallel.DistributedDataParallel(
        module=backbone, broadcast_buffers=False, bucket_cap_mb=16, find_unused_parameters=True)
    backbone.register_comm_hook(None, fp16_compress_hook)
    backbone.train()
    backbone._set_static_graph()
    margin = CombinedMarginLoss(64, *spec["margins"], 0)
    head = PartialFC_V2(margin, 512, spec["classes"], spec["sample_ratio"], False)
    head.train()
    groups = [{"params": backbone.parameters()}, {"params": head.parameters()}]
    if spec["optimizer"] == "sgd":
        opt = torch.optim.SGD(params=groups, lr=spec["lr"], momentum=0.9,
                              weight_decay=spec["weight_decay"])
    else:
        opt = torch.optim.AdamW(params=groups, lr=spec["lr"], weight_decay=spec["weight_decay"])
    sched = PolynomialLRWarmup(optimizer=opt, warmup_iters=0, total_iters=steps)
    return backbone, head, opt, sched


def train(loader, backbone, head, opt, sched, steps, save_dir, rank):
    """train_v2.py's loop for `steps` steps; per-step [wall s, data-wait s, save s]."""
    import torch
    records, step, epoch = [], 0, 0
    start = time.perf_counter()
    while step < steps:
        loader.sampler.set_epoch(epoch)
        batches = iter(loader)
        while step < steps:
            t0 = time.perf_counter()
            try:
                img, labels = next(batches)
            except StopIteration:
                break
            data = time.perf_counter() - t0
            step += 1
            loss = head(backbone(img), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            opt.step()
            opt.zero_grad()
            sched.step()
            loss.item()  # train_v2: loss_am.update(loss.item(), 1)
            now = time.perf_counter()
            records.append({"step": step, "wall_s": now - start, "data": data,
                            "vm_rss_mb": status_mb("VmRSS"), "vm_hwm_mb": status_mb("VmHWM")})
            start = now
        epoch += 1
        if rank == 0:  # train_v2 saves the backbone at each epoch's end: not in a step's time
            t0 = time.perf_counter()
            os.makedirs(save_dir, exist_ok=True)
            torch.save(backbone.module.state_dict(), os.path.join(save_dir, "model.pt"))
            start += time.perf_counter() - t0
    return records


def status_mb(key):
    """/proc/self/status's `key` (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith(key + ":"))


def vm_hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arcface-torch", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--spec", required=True, help="the case as JSON (benchmark_train.case_spec)")
    ap.add_argument("--batch", type=int, required=True, help="per rank")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=2048)  # arcface_torch's configs/base.py
    ap.add_argument("--out", required=True, help="prefix of the rank reports")
    ap.add_argument("--save-dir", required=True)
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.arcface_torch))
    import warnings
    warnings.filterwarnings("ignore")  # torch.cuda.amp.autocast(False) on the CPU, etc.
    import torch
    torch.set_num_threads(args.threads)
    shims(torch)
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    from utils.utils_distributed_sampler import setup_seed
    setup_seed(seed=args.seed, cuda_deterministic=False)
    spec = json.loads(args.spec)
    loader = build_loader(args.images, args.batch, args.workers, rank, world, args.seed)
    backbone, head, opt, sched = build_model(spec, args.steps)
    records = train(loader, backbone, head, opt, sched, args.steps, args.save_dir, rank)
    report = {"rank": rank, "world": world, "global_batch": args.batch * world,
              "phases": ["data"], "steps": records, "vm_hwm_bytes": vm_hwm(), "pid": os.getpid(),
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(report, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
