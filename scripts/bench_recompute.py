"""Activation checkpointing and ``torch.compile`` on CPU: memory held for backward and step time.

    python scripts/bench_recompute.py [--preset smollm-tiny] [--batch 4] [--seq-len 256] [--repeats 5]

One process, fp32, SDPA. For each activation-checkpointing mode (none, selective, full, full on
every 2nd block) with compile off and on: the bytes one training forward allocates and still
holds when backward starts (the CPU profiler's allocations minus frees: everything saved for
backward), and the median forward+backward time over `--repeats` rounds in which every
configuration runs once, alternating, so machine noise hits all alike. Printed as ratios to
`none` / eager, the issue's targets being: full <= 0.30x the memory of none at <= 1.4x its time,
selective in between. On a GPU, `scripts/bench_gpu.py` measures the same options in tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout, not installed
from nanolight.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from nanolight.parallel.blocks import BlockOptions  # noqa: E402

MODES = [("none", 1), ("selective", 1), ("full", 1), ("full", 2)]


def build(preset: str, mode: str, every: int, compiled: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights for every configuration
    model = LlamaForCausalLM(LlamaConfig.preset(preset, attn_implementation="sdpa"))
    BlockOptions(mode, every, compiled).apply(model, announce=False)
    return model


def held_bytes(model: LlamaForCausalLM, ids: torch.Tensor) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(ids, labels=ids)
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return held


def step_seconds(model: LlamaForCausalLM, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(ids, labels=ids).backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm-tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="eager only")
    args = p.parse_args()
    vocab = LlamaConfig.preset(args.preset).vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))
    configs = [(m, k, c) for c in ([False] if args.no_compile else [False, True]) for m, k in MODES]
    models = {cfg: build(args.preset, *cfg) for cfg in configs}
    memory = {
        cfg: held_bytes(models[cfg], ids) for cfg in configs if not cfg[2]
    }  # eager: what autograd holds
    for model in models.values():  # warm-up: compilation, allocator
        step_seconds(model, ids)
    times: dict[tuple, list[float]] = {cfg: [] for cfg in configs}
    for _ in range(args.repeats):
        for cfg, model in models.items():
            times[cfg].append(step_seconds(model, ids))
    med = {cfg: statistics.median(t) for cfg, t in times.items()}
    base_mem, base_t = memory[("none", 1, False)], med[("none", 1, False)]
    print(f"{args.preset} B={args.batch} T={args.seq_len} fp32 CPU, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")  # fmt: skip
    print(
        f"{'recompute':<12}{'compile':<9}{'held MiB':>9}{'vs none':>9}{'fwd+bwd ms':>12}{'vs none':>9}{'vs eager':>9}"
    )
    for mode, every, compiled in configs:
        cfg = (mode, every, compiled)
        name = mode if every == 1 else f"{mode}/{every}"
        mem = memory.get((mode, every, False))
        eager_t = med[(mode, every, False)]
        print(
            f"{name:<12}{'on' if compiled else 'off':<9}{mem / 2**20:>9.1f}{mem / base_mem:>9.2f}"
            f"{med[cfg] * 1e3:>12.1f}{med[cfg] / base_t:>9.2f}{med[cfg] / eager_t:>9.2f}"
        )


if __name__ == "__main__":
    main()
