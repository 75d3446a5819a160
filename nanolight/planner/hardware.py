"""The accelerators the planner knows: published figures, and this machine's CPU, measured.

Figures are per GPU, from the vendors' datasheets (dense, i.e. without 2:4 sparsity; links per
direction, the rate a ring collective's every step runs at):

- H100 SXM / PCIe: NVIDIA H100 Tensor Core GPU datasheet (2023): BF16 989 / 756 TFLOPS, TF32
  495 / 378, FP32 67 / 51, 80 GB HBM at 3.35 / 2.0 TB/s, NVLink 900 GB/s (450 each way) on SXM;
  the PCIe card talks over PCIe Gen5 x16 (64 GB/s each way; its NVLink bridge joins pairs only).
- H200 SXM: NVIDIA H200 datasheet: BF16 989 TFLOPS, TF32 495, FP32 67, 141 GB HBM3e at 4.8 TB/s,
  NVLink 900 GB/s.
- H100 NVL / H200 NVL (PCIe boards at lower clocks and power): NVIDIA's datasheets: BF16 835 TFLOPS,
  TF32 418, FP32 60, 94 GB HBM3 at 3.9 TB/s / 141 GB HBM3e at 4.8 TB/s; their NVLink bridges join
  two (or four) boards, so a group of a node talks over PCIe Gen5 x16, as the H100 PCIe's.
- A100 SXM 40 / 80 GB: NVIDIA A100 datasheet: BF16 312 TFLOPS, TF32 156, FP32 19.5, HBM2(e) at
  1.555 / 2.039 TB/s, NVLink 600 GB/s (300 each way).
- B200: NVIDIA HGX B200 / DGX B200 datasheets: 180 GB HBM3e at 8 TB/s, FP8 72 PFLOPS sparse per
  8 GPUs, i.e. BF16 2.25 PFLOPS dense per GPU (TF32 1.1, FP32 600 TFLOPS per 8 GPUs: 75), NVLink 5
  at 1.8 TB/s (900 each way).
- PCIe cards without NVLink, each on PCIe Gen4 x16 (32 GB/s each way), from their datasheets
  (dense): L40S BF16 362 TFLOPS, TF32 183, FP32 91.6, 48 GB at 864 GB/s; L4 121 / 60 / 30.3,
  24 GB at 300 GB/s; A10 125 / 62.5 / 31.2, 24 GB at 600 GB/s; GeForce RTX 4090 (Ada whitepaper,
  FP32 accumulate) 165 / 82.6 / 82.6, 24 GB at 1,008 GB/s. Their servers' network varies: 25 GB/s
  (200 Gb/s) is assumed.
- Between nodes: DGX H100 / H200 / B200 give each GPU a 400 Gb/s ConnectX-7 port (50 GB/s), DGX
  A100 a 200 Gb/s HDR port (25 GB/s).

`efficiency` is the fraction of the peak the model's matmuls reach. No GPU is at hand to measure
it, so it is the MFU ballpark published for Llama-size dense training at these scales (Megatron-LM,
torchtitan, nanotron's SmolLM3 runs: 40-55%, before pipeline and communication losses, which the
time model adds itself): 0.55. `link_efficiency`: NCCL's bus bandwidth reaches ~80% of the link; `latency`: a small message or
collective costs ~10-20 us with NCCL within a node and across InfiniBand (nccl-tests' small sizes),
so each collective is charged latency + bytes / bandwidth (Hockney's model).
The `cpu` entry is calibrated instead (`calibrate_cpu`): its peak *is* the measured matmul rate.
A GPU the run is on (`at_hand`) gets the host's cost of issuing a block measured, the floor of
a small block's time; a table entry alone has none (the step is then its FLOPs).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from nanolight.errors import UsageError
from nanolight.models.llama import LlamaConfig
from nanolight.planner.probes import CPU, block_seconds, free_port, join_local_gloo, one_thread

GB = 10**9
TERA = 10**12


@dataclass(frozen=True)
class Hardware:
    """One accelerator (and its links) as the time and memory models see it."""

    name: str
    bf16_flops: float  # dense peak, FLOP/s
    fp32_flops: float  # the rate 32-true's matmuls run at (TF32 on GPUs)
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s per GPU per direction (NVLink / PCIe)
    inter_node_bandwidth: float  # bytes/s per GPU (InfiniBand)
    gpus_per_node: int = 8
    efficiency: float = 0.55
    link_efficiency: float = 0.8
    device: str = "cuda"
    shared_cores: int = 0  # cpu: the ranks of one machine share this many cores
    latency: float = 15e-6  # seconds one small collective or message costs, whatever its size
    concurrency: float = 1.0  # cpu: the matmul rate each of `shared_cores` busy ranks keeps (vs one alone)
    block_overhead: float = 0.0  # seconds of host work per block forward + backward, whatever its size
    profiled: bool = (
        False  # hardware at hand: compute is timed at the workload's shapes (`planner/probes.py`)
    )
    ieee_fp32_flops: float | None = None  # fp32 matmuls with TF32 off (None: no figure at hand)

    def flops(self, precision: str) -> float:
        """Peak matmul rate for a precision mode (bf16 compute for every bf16 mode)."""
        return self.fp32_flops if precision == "32-true" else self.bf16_flops

    def link(self, span: int) -> float:
        """Effective bandwidth of a group whose ranks lie within `span` consecutive ranks."""
        raw = self.intra_node_bandwidth if span <= self.gpus_per_node else self.inter_node_bandwidth
        return raw * self.link_efficiency


def _gpu(
    name: str,
    bf16: float,
    tf32: float,
    mem_gb: float,
    hbm_tb: float,
    nvlink: float,
    ib: float,
    fp32: float | None,
) -> Hardware:
    return Hardware(
        name,
        bf16 * TERA,
        tf32 * TERA,
        int(mem_gb * GB),
        hbm_tb * 1000 * GB,
        nvlink * GB,
        ib * GB,
        ieee_fp32_flops=None if fp32 is None else fp32 * TERA,
    )


HARDWARE: dict[str, Hardware] = {
    "h100-sxm": _gpu("h100-sxm", 989, 495, 80, 3.35, 450, 50, 67),
    "h100-pcie": _gpu("h100-pcie", 756, 378, 80, 2.0, 64, 50, 51),
    "h200": _gpu("h200", 989, 495, 141, 4.8, 450, 50, 67),
    "h100-nvl": _gpu("h100-nvl", 835, 418, 94, 3.9, 64, 50, 60),
    "h200-nvl": _gpu("h200-nvl", 835, 418, 141, 4.8, 64, 50, 60),
    "a100-40gb": _gpu("a100-40gb", 312, 156, 40, 1.555, 300, 25, 19.5),
    "a100-80gb": _gpu("a100-80gb", 312, 156, 80, 2.039, 300, 25, 19.5),
    "b200": _gpu("b200", 2250, 1100, 180, 8.0, 900, 50, 75),
    "l40s": _gpu("l40s", 362, 183, 48, 0.864, 32, 25, 91.6),
    "l4": _gpu("l4", 121, 60, 24, 0.3, 32, 25, 30.3),
    "a10": _gpu("a10", 125, 62.5, 24, 0.6, 32, 25, 31.2),
    "rtx-4090": _gpu("rtx-4090", 165, 82.6, 24, 1.008, 32, 25, 82.6),
}


def hardware(name: str) -> Hardware:
    """A table entry by name, or `cpu` measured now."""
    if name == "cpu":
        return calibrate_cpu()
    if name not in HARDWARE:
        raise UsageError(
            f"unknown GPU {name!r} (+cluster.gpu); choose one of {', '.join([*HARDWARE, 'cpu'])}"
        )
    return HARDWARE[name]


# the table's entry for a device name as `torch.cuda.get_device_name` reports it, most specific first
DEVICE_NAMES = (
    ("h100 pcie", "h100-pcie"),
    ("h100 nvl", "h100-nvl"),
    ("h100", "h100-sxm"),
    ("h200 nvl", "h200-nvl"),
    ("h200", "h200"),  # and GH200
    ("a100-sxm4-40gb", "a100-40gb"),
    ("a100-pcie-40gb", "a100-40gb"),
    ("a100", "a100-80gb"),
    ("b200", "b200"),
    ("l40s", "l40s"),
    (" l4 ", "l4"),  # a word of its own: not L40 or L40S
    (" a10 ", "a10"),  # not A100
    ("a10g", "a10"),  # AWS's A10G: the A10's figures
    ("4090", "rtx-4090"),
)


def table_name(device_name: str) -> str | None:
    """The `HARDWARE` key of a CUDA device name ("NVIDIA H100 80GB HBM3" -> h100-sxm), or None."""
    name = f" {device_name.lower()} "  # padded: a pattern may ask for a whole word
    return next((key for pattern, key in DEVICE_NAMES if pattern in name), None)


def _rate(work: Callable[[], object], repeats: int, batches: int = 5) -> float:
    """Seconds of one `work()`: the median of `batches` timed runs of `repeats` calls each, after a
    warm-up. The median, because the machine is shared: a run another process interrupted is an
    outlier, not the rate (one run of many calls moved +-40% between calibrations)."""
    work()  # warm-up
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(repeats):
            work()
        times.append((time.perf_counter() - start) / repeats)
    return statistics.median(times)


def calibrate_cpu(size: int = 256, copy_mb: int = 64) -> Hardware:
    """This machine, measured in a few seconds: one thread's fp32 matmul rate at the tiny
    models' sizes (as the ranks of a gloo test run: one thread each), what of it each rank keeps
    when every core is busy (`concurrency`: cores that share caches or a physical core give less),
    the fixed host cost of a decoder block's forward and backward (`block_overhead`: operator
    dispatch, which dominates small models on a CPU), memcpy bandwidth, and two gloo ranks'
    all-reduce rate and the latency of a collective between busy ranks (`gloo_bandwidth`)."""
    with one_thread():
        src = torch.empty(copy_mb * 2**20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        copy = 2 * src.numel() / _rate(lambda: dst.copy_(src), 5)  # read + write
    cores = os.cpu_count() or 1
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    link, latency = gloo_bandwidth()
    flops, concurrency = _matmul_rates(size, cores)
    return Hardware(
        "cpu",
        flops,
        flops,
        total,
        copy,
        link,
        link,
        gpus_per_node=max(cores, 64),
        efficiency=1.0,
        link_efficiency=1.0,
        device="cpu",
        shared_cores=cores,
        latency=latency,
        concurrency=concurrency,
        block_overhead=_block_overhead(),
        profiled=True,
    )


def _matmul_rate(size: int) -> float:
    """FLOP/s of one thread's fp32 (size x size) matmuls."""
    with one_thread():
        a, b = torch.randn(size, size), torch.randn(size, size)
        return 2 * size**3 / _rate(lambda: a @ b, 50)


def _matmul_rates(size: int, cores: int, pairs: int = 3) -> tuple[float, float]:
    """(one thread's matmul rate alone, the fraction of it each of `cores` busy threads keeps):
    medians over `pairs` alternations of the two, so that a load change on the shared machine
    between them moves both sides of a pair, not the ratio."""
    alone, shared = [], []
    for _ in range(pairs):
        alone.append(_matmul_rate(size))
        if cores > 1:
            shared.append(statistics.mean(forked(lambda _: _matmul_rate(size), cores)) / alone[-1])
    return statistics.median(alone), min(1.0, statistics.median(shared)) if shared else 1.0


def _block_overhead(device: torch.device = CPU, precision: str = "32-true") -> float:
    """Seconds of one tiny decoder block's forward and backward on one thread, on `device`: its
    FLOPs are negligible, so this is the per-operator host cost every block pays at any size."""
    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    tiny = LlamaConfig(**sizes, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8)
    return block_seconds(tiny, 1, 8, "none", precision, device)


def at_hand(hw: Hardware, device: torch.device) -> Hardware:
    """`hw`, the table's entry for the GPU `device` is, with the host's cost of a block measured on
    it. Eager PyTorch issues a block's few dozen kernels one by one; a GPU runs a small block's
    kernels faster than the host issues them, so that cost is the block's floor
    (`timing.micro_batch_work`): what makes a larger micro-batch faster for a small model. Timed
    under bf16 autocast, which issues the most kernels of the GPU precisions."""
    return replace(hw, block_overhead=_block_overhead(device, "bf16-mixed"))


def forked(fn: Callable[[int], Any], n: int) -> list[Any]:
    """`fn(i)` for i in range(n), in `n` processes at once (forked: no re-import of torch, they
    start in milliseconds); the results that are not None, in the order they arrive."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=lambda i=i: out.put(fn(i))) for i in range(n)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
    return [r for r in results if r is not None]


BUSY_WORK_S = 2e-3  # the compute between two collectives of the latency probe: a small block's forward


def gloo_bandwidth(megabytes: int = 16) -> tuple[float, float]:
    """(bytes/s, seconds of latency) of two gloo ranks on this machine, measured in a short-lived
    pair of processes: a large all-reduce's size over its time, and what a one-element all-reduce
    adds to ranks that compute between collectives (as tp's ranks do in training). Idle, that
    collective costs ~0.15 ms here; between busy ranks ~1-2 ms: each waits for the other, whom
    the shared cores delay, and wakes from that wait. The busy figure is the one training pays."""
    port = free_port()
    (rate,) = forked(lambda rank: _allreduce_rank(rank, megabytes, port), 2)
    return rate


def _allreduce_rank(rank: int, megabytes: int, port: int, repeats: int = 5) -> tuple[float, float] | None:
    import torch.distributed as dist

    join_local_gloo(rank, 2, port)
    x, tiny = torch.ones(megabytes * 2**18), torch.ones(1)  # fp32
    # the two ranks all-reduce one buffer a few times: the measured rate stands for every gloo link
    seconds = _rate(lambda: dist.all_reduce(x), 3, batches=3)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    count = torch.tensor([max(1, round(BUSY_WORK_S / _rate(lambda: a @ b, 20)))])
    # the pair agrees on the work between collectives (the larger count), so neither waits for more work
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    matmuls = int(count)

    def compute() -> None:
        for _ in range(matmuls):
            a @ b

    def synced() -> None:
        compute()
        # the two ranks sum one element: the wait for the peer and the wake-up, no bytes to speak of
        dist.all_reduce(tiny)

    added = []
    for _ in range(repeats):  # alternated, so that the machine's load weighs on both alike
        dist.barrier()  # the pair starts each timing together
        plain = _rate(compute, 10, batches=1)
        dist.barrier()
        added.append(_rate(synced, 10, batches=1) - plain)
    dist.destroy_process_group()
    return (x.numel() * 4 / seconds, max(0.0, statistics.median(added))) if rank == 0 else None


__all__ = [
    "HARDWARE",
    "Hardware",
    "calibrate_cpu",
    "gloo_bandwidth",
    "hardware",
    "table_name",
]
