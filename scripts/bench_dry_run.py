"""The planner held to the dry run at the sizes people train (issue 37; a benchmark, not a test).

    python scripts/bench_dry_run.py [--configs smollm-1.7b@8 llama3-8b@512 ...] [--top 5] [--gpu h100-sxm]

For each config (`CONFIGS`: smollm-1.7b on 8 and 64 GPUs, llama3-8b on 64 and 512), the planner's
search (`planner/search.py` `plan`) ranks every layout; its `--top` best that fit are each run by
the dry run (`pretrain/dry_run.py`: the recipe's real program under fake tensors and a fake
process group) for the pipeline stage at the planner's peak only (a full-size role takes minutes
on this machine). Printed per layout: each memory part, planner vs dry run, and their ratio; the
peak; the step time, the planner's against the dry run's roofline (torch's FLOP counts at the
GPU's peak), stretched by the schedule's own bubble (`schedules.bubble_fraction`) where the
layout is pipelined (the dry run plays one rank and sees no bubble), plus its collectives by the
ring model, one after another. Per config: Spearman's rank correlation of the two step-time
orders (issue target >= 0.9), of the compute orders alone (the planner's compute, bubble and
optimizer step -- the roofline prices the step's optimizer operators too -- against the stretched
roofline), of the planner's step against the stretched roofline (the
optimizer step in it) plus the planner's own communication parts (the issue's "RuntimeEstimator plus its own communication
model": the dry run's sum overlaps nothing, where the code overlaps dp's buckets with the
backward), and the largest memory-part error (target 5%). The five best are often within a few
percent of each other, where one swapped pair costs Spearman 0.1: so each order also gets a measure
that ties do not sway, how much slower than the dry run's fastest the planner's pick is by it.

The planner's side is its CPU workload (`Workload(device="cpu")`): the dry run runs this
machine's kernels, whose one difference from a GPU's is the fused loss's token chunk
(README, "Before you queue a job"); the GPU workload's peak is printed beside it. The parts are
named alike but for two: the planner's `parameters` are the tracker's weights, and what the
tracker files under activations and temporaries at the peak is compared with the planner's
activations plus its transient (the two split the same bytes at a different moment).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout, not installed

from bench_planner import spearman  # noqa: E402

from nanolight.models.llama_config import LlamaConfig  # noqa: E402
from nanolight.parallel.pipeline.schedules import bubble_fraction  # noqa: E402
from nanolight.planner.hardware import hardware  # noqa: E402
from nanolight.planner.layout import Layout  # noqa: E402
from nanolight.planner.memory import Workload, rank_memory  # noqa: E402
from nanolight.planner.search import plan  # noqa: E402
from nanolight.pretrain.auto import apply_layout  # noqa: E402
from nanolight.pretrain.config import ClusterConfig, PretrainConfig, TrainConfig  # noqa: E402
from nanolight.pretrain.dry_run import RoleReport, dry_run  # noqa: E402

GIB = 2**30
# name -> (model preset, GPUs, seq_len, global batch tokens): the four. The batches are
# small for their world (64-512 sequences): a dry run's cost is its micro-batches (about 7 s each
# for smollm-1.7b's 24 layers on this machine's shared cores), and the comparison needs several
# of them per step only for the pipeline's schedule.
CONFIGS = {
    "smollm-1.7b@8": ("smollm-1.7b", 8, 2048, 2**17),
    "smollm-1.7b@64": ("smollm-1.7b", 64, 2048, 2**18),
    "llama3-8b@64": ("llama3-8b", 64, 8192, 2**20),
    "llama3-8b@512": ("llama3-8b", 512, 8192, 2**22),
}
# (label, the planner's parts, the dry run's parts) compared. The rest of a peak is compared as
# one sum: the tracker files a buffer a collective writes under communication (sequence
# parallelism's gathered block inputs, which autograd then saves) and what the forward made under
# activations or temporaries by when it was made; the planner files the same bytes by what holds
# them (`tests/test_dry_run.py` compares the same sums).
HELD = "activations+transient+communication"
PARTS = (
    ("weights", ("parameters",), ("weights",)),
    ("gradients", ("gradients",), ("gradients",)),
    ("optimizer_state", ("optimizer_state",), ("optimizer_state",)),
    (HELD, ("activations", "transient", "communication"), ("activations", "temporaries", "communication")),
)


def describe(lay: Layout) -> str:
    sched = f" {lay.pp_schedule} v{lay.pp_virtual}" if lay.pp > 1 else ""
    return (
        f"tp{lay.tp} cp{lay.cp} pp{lay.pp}{sched} dp{lay.dp} zero{lay.zero_stage}"
        f"{' sp' if lay.sequence_parallel else ''} {lay.activation_checkpointing} mbs{lay.micro_batch_size}"
        f" x{lay.accumulate_grad_batches} {lay.precision}"
    )


def dry_run_compute(role: RoleReport, lay: Layout) -> float:
    """The dry run's compute estimate: its rank's roofline, stretched by the schedule's bubble."""
    return role.compute_s / (1 - bubble_fraction(lay.accumulate_grad_batches, lay.pp, lay.pp_virtual))


def regret(planned: list[float], measured: list[float]) -> float:
    """How much slower than the measured fastest the planner's pick measures (0: it is the fastest)."""
    return measured[planned.index(min(planned))] / min(measured) - 1


def compare(name: str, top: int, gpu: str) -> tuple[float, float, float, float, list[float]]:
    """Print the config's table; (Spearman of the step-time orders, of the compute orders, of the
    step against the roofline plus the planner's communication, largest memory-part error, and
    the planner's pick's `regret` by each of the three)."""
    preset, gpus, seq_len, tokens = CONFIGS[name]
    hw = hardware(gpu)
    model = LlamaConfig.preset(preset)
    work, cpu_work = Workload(model, seq_len, hw.device), Workload(model, seq_len, "cpu")
    started = time.perf_counter()
    best = [p for p in plan(work, gpus, tokens, hw) if p.fits][:top]
    print(f"== {name}: {preset}, seq {seq_len}, {tokens:,} tokens per step on {gpus} x {gpu} ", end="")
    print(f"(planned in {time.perf_counter() - started:.0f} s)", flush=True)
    base = PretrainConfig(
        model=model,
        trainer=TrainConfig(seq_len=seq_len),
        cluster=ClusterConfig(gpus=gpus, gpu=gpu),
    )
    planned_steps, measured_steps, planned_compute, measured_compute, worst = [], [], [], [], 0.0
    overlapped = []  # the dry run's compute + the planner's communication
    for i, prediction in enumerate(best, 1):
        lay = prediction.layout
        stage = max(range(lay.pp), key=lambda s: rank_memory(work, lay, s)["total"])
        planned = rank_memory(cpu_work, lay, stage)
        started = time.perf_counter()
        (role,) = dry_run(apply_layout(base, lay), stages=[stage]).roles
        seconds = time.perf_counter() - started
        print(f"[{i}] {describe(lay)}: pp stage {stage} (rank {role.rank}), dry run {seconds:.0f} s")
        print(f"    {'part':<36}{'planner GiB':>12}{'dry run GiB':>12}{'ratio':>8}")
        for label, ours, theirs in PARTS:
            p, d = sum(planned[k] for k in ours), sum(role.parts[k] for k in theirs)
            ratio = p / d if d else float("nan") if p else 1.0
            if d >= 2**20:  # parts under a MiB (a bf16-master rank's): not an error worth a ratio
                worst = max(worst, abs(ratio - 1))
            print(f"    {label:<36}{p / GIB:>12.3f}{d / GIB:>12.3f}{ratio:>8.3f}")
        p, d = planned["total"], role.peak
        print(f"    {'peak':<36}{p / GIB:>12.3f}{d / GIB:>12.3f}{p / d:>8.3f}", end="")
        print(
            f"   (planner, GPU kernels and allocator allowance: {prediction.memory_bytes['total'] / GIB:.3f})"
        )
        ours, theirs = prediction.step_time_s, dry_run_compute(role, lay) + role.comm_s
        planned_steps.append(ours)
        measured_steps.append(theirs)
        planned_compute.append(sum(prediction.step_parts[k] for k in ("compute", "bubble", "optimizer")))
        measured_compute.append(dry_run_compute(role, lay))
        talk = ("pipeline_fill", "step_collectives", "dp_reduce_exposed", "zero_all_gather")
        overlapped.append(dry_run_compute(role, lay) + sum(prediction.step_parts[k] for k in talk))
        print(
            f"    step s: planner {ours:.3f} (compute {prediction.step_parts['compute']:.3f}, bubble "
            f"{prediction.step_parts['bubble']:.3f}); dry run {theirs:.3f} (roofline {role.compute_s:.3f}, "
            f"{role.flops / 1e12:.1f} TFLOP; collectives {role.comm_s:.3f})",
            flush=True,
        )
    rho, compute_rho = spearman(planned_steps, measured_steps), spearman(planned_compute, measured_compute)
    comm_rho = spearman(planned_steps, overlapped)
    regrets = [
        regret(planned_steps, measured_steps),
        regret(planned_compute, measured_compute),
        regret(planned_steps, overlapped),
    ]
    print(
        f"== {name}: Spearman of the step-time orders {rho:.2f} (compute, bubble and optimizer alone "
        f"{compute_rho:.2f}; roofline + the planner's communication {comm_rho:.2f}); largest memory-part "
        f"error {worst:.1%}; the planner's pick is {', '.join(f'{r:.1%}' for r in regrets)} slower than "
        "the dry run's fastest by the same three"
    )
    return rho, compute_rho, comm_rho, worst, regrets


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--top", type=int, default=5, help="the planner's best layouts that fit, per config")
    parser.add_argument("--gpu", default="h100-sxm", help="planner/hardware.py's table name")
    args = parser.parse_args()
    summary = {name: compare(name, args.top, args.gpu) for name in args.configs}
    for name, (rho, compute_rho, comm_rho, worst, regrets) in summary.items():
        print(
            f"{name:>16}: Spearman {rho:.2f} ({compute_rho:.2f} compute, {comm_rho:.2f} with the planner's "
            f"communication), largest memory-part error {worst:.1%}; the pick's regret "
            + " / ".join(f"{r:.1%}" for r in regrets)
        )
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"host: peak resident set {peak_rss:.2f} GiB")


if __name__ == "__main__":
    main()
