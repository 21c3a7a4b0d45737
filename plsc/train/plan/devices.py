"""Device profiles the planner projects onto: memory, dense GEMM rate, interconnect bandwidth.

Every figure of a GPU profile is an assumption taken from the vendor's datasheet (named in
`source`), not a measurement of plsc: the GEMM rate is the datasheet's dense (no sparsity)
16-bit tensor-core rate, so a step time from it is a lower bound; the bandwidths are what one
GPU can send in one direction (NVLink within a node of `per_node` GPUs, the node's InfiniBand
shared by its GPUs beyond it). `fixed_bytes` is what a process holds on the device before plsc
allocates anything (CUDA context, cuBLAS/cuDNN workspaces): an assumption, stated as such.

The "cpu" profile is this project's machine (2 cores, 24 GiB): memory is the machine's
MemTotal shared by the ranks (after the launcher's own process), the rates were measured here
(docs/memory_and_benchmarks.md) and the process's fixed cost is measured too
(`plsc.train.plan.measured`).
"""
from dataclasses import dataclass

__all__ = ["Profile", "PROFILES", "profile"]

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Profile:
    name: str
    memory_bytes: int  # per device (cpu: the machine's, shared by the ranks of a node)
    gemm_flops: float  # dense GEMM FLOP/s of one device (one rank on the cpu profile)
    fp32_flops: float  # float32 FLOP/s (without AMP)
    intra_bw: float  # bytes/s one rank sends within a node
    inter_bw: float  # bytes/s one rank sends across nodes
    per_node: int  # ranks per node
    fixed_bytes: int  # the device's share a process holds before plsc allocates (GPU: context)
    gpu: bool
    source: str


PROFILES = {
    "v100-32gb": Profile(
        "v100-32gb", 32510 * MiB, 125e12, 15.7e12, 150e9, 6.25e9, 8, 1 * GiB, True,
        "NVIDIA Tesla V100 SXM2 datasheet: 125 TFLOPS tensor (fp16), 15.7 TFLOPS fp32, NVLink "
        "300 GB/s (150 GB/s a direction); 32,510 MiB usable as nvidia-smi reports it (PLSC's "
        "README); DGX-1: 4 x 100 Gb/s InfiniBand for 8 GPUs (6.25 GB/s a GPU); 1 GiB CUDA "
        "context and library workspaces (assumed)"),
    "a100-80gb": Profile(
        "a100-80gb", 80 * GiB, 312e12, 19.5e12, 300e9, 25e9, 8, 1 * GiB, True,
        "NVIDIA A100 80GB SXM datasheet: 312 TFLOPS dense fp16/bf16, 19.5 TFLOPS fp32, NVLink "
        "600 GB/s (300 a direction); DGX A100: 8 x 200 Gb/s HDR InfiniBand (25 GB/s a GPU); "
        "1 GiB CUDA context and workspaces (assumed)"),
    "h100-80gb": Profile(
        "h100-80gb", 80 * GiB, 989e12, 67e12, 450e9, 50e9, 8, 1 * GiB, True,
        "NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense fp16/bf16, 67 TFLOPS fp32, NVLink "
        "900 GB/s (450 a direction); DGX H100: 8 x 400 Gb/s NDR InfiniBand (50 GB/s a GPU); "
        "1 GiB CUDA context and workspaces (assumed)"),
}


def _mem_total():
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        return 24 * GiB


def cpu_profile():
    """This machine: MemTotal; 87.7 GFLOP/s per rank (one MKL AVX2 thread, the head's GEMMs,
    `benchmarks/benchmark_cpu.py`); gloo on loopback 0.64 GB/s (a 32 MB all-reduce on 2 ranks
    in 0.05 s, docs/memory_and_benchmarks.md)."""
    return Profile("cpu", _mem_total(), 87.7e9, 87.7e9, 0.64e9, 0.64e9, 1 << 30, 0, False,
                   "this machine: MemTotal from /proc/meminfo; 87.7 GFLOP/s a rank (one thread, "
                   "benchmarks/benchmark_cpu.py); gloo 0.64 GB/s (benchmarks/benchmark_overlap.py)")


def profile(name):
    """The profile called `name` (`PROFILES` or "cpu"); ValueError naming the choices."""
    if name == "cpu":
        return cpu_profile()
    if name not in PROFILES:
        raise ValueError(f"--device {name!r}: choose one of cpu, {', '.join(PROFILES)}")
    return PROFILES[name]
