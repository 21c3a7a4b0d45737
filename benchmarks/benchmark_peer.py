"""The planner's own path (`plan(..., peer=...)`, `tools/plan.py --peer`) given arcface_torch's
head (plsc/train/plan/peers.py) against arcface_torch's published memory table (README, "GPU Memory Utilization ... Partial FC 0.1", 8 x V100 32 GB,
IResNet50, 128 a GPU, fp16): predicted vs published MiB a GPU at every row, and the class
capacity at the V100's 32,510 MiB. No GPU needed; docs/scaling.md shows the output.

    python benchmarks/benchmark_peer.py [--version v1|v2]
"""
import argparse
import copy

from plsc.process import startup

startup.hold()

from plsc.config import load_config  # noqa: E402
from plsc.train.plan import peers, plan  # noqa: E402
from plsc.train.plan.model import _Context, memory  # noqa: E402
from plsc.train.plan.devices import profile  # noqa: E402

MiB = 1 << 20
# arcface_torch README (and docs/speed_benchmark.md) at c0b95cc6, Partial FC 0.1 column, MB a GPU
PUBLISHED = {125_000: 4868, 250_000: 5004, 500_000: 5202, 1_000_000: 5620, 1_400_000: 6056,
             2_000_000: 6472, 4_000_000: 8284, 5_500_000: 9854, 8_000_000: 12310,
             16_000_000: 19950, 29_000_000: 32324}
PUBLISHED_CAPACITY = 29_000_000


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--version", choices=peers.VERSIONS, default="v1")
    args = p.parse_args()
    cfg = load_config("configs/arcface_r50.yaml",
                      ["Loss.sample_ratio=0.1", "Data.batch_size=128", "AMP.enable=true"])
    print(f"arcface_torch {args.version}: head bytes per class at 1M a rank: "
          f"{peers.per_class_bytes(args.version, 512, 0.1, 1024, 8):.0f}")
    peer = f"arcface_torch_{args.version}"
    ctx = _Context(cfg, 8, profile("v100-32gb"), peer)
    print("| classes | published MiB a GPU | predicted MiB a GPU | error |")
    print("| --- | --- | --- | --- |")
    for classes, published in PUBLISHED.items():
        trial = copy.deepcopy(cfg)
        trial["Loss"]["num_classes"] = classes
        mib = sum(memory(trial, ctx).values()) / MiB
        print(f"| {classes:,} | {published:,} | {mib:,.0f} | {100 * (mib / published - 1):+.1f} % |")
    cap = plan(cfg, 8, "v100-32gb", peer=peer).capacity
    print(f"capacity at 32,510 MiB: predicted {cap:,}, published {PUBLISHED_CAPACITY:,} "
          f"({100 * (cap / PUBLISHED_CAPACITY - 1):+.1f} %)")
    own = plan(cfg, 8, "v100-32gb")
    print(f"plsc's own head, same layout: capacity {own.capacity:,}; head bytes per class "
          + ", ".join(f"{k} {v:g}" for k, v in own.head_per_class.items()))


if __name__ == "__main__":
    main()
