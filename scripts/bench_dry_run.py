"""The planner held to the dry run at the sizes people train (issue 37; a benchmark, not a test).

    python scripts/bench_dry_run.py [--configs smollm-1.7b@8 llama3-8b@512 ...] [--top 5] [--gpu h100-sxm]

For each config (`CONFIGS`: smollm-1.7b on 8 and 64 GPUs, llama3-8b on 64 and 512), the planner's
search (`planner/search.py` `plan`) ranks every layout; its `--top` best that fit are each run by
the dry run (`pretrain/dry_run.py`: the recipe's real program under fake tensors and a fake
process group) for the pipeline stage at the planner's peak only (a full-size role takes minutes
on this machine). Printed per layout: each memory part, planner vs dry run, and their ratio; the
peak; the step time, the planner's against the dry run's roofline (torch's FLOP counts), stretched
by the schedule's own bubble (`schedules.bubble_fraction`) where the layout is pipelined (the dry
run plays one rank and sees no bubble). Per config, three orders of the five layouts, each the
planner's against the dry run's by Spearman's rank correlation (issue target >= 0.9):

    step      the planner's step; the roofline plus every collective by the ring model, one after
              another (the code overlaps dp's buckets with the backward: this sum does not)
    compute   the planner's compute, bubble and optimizer step, less its communication inside the
              micro-batches (`timing.micro_batch_communication`: tp collectives, ring, pipeline
              messages); the roofline alone (it prices the optimizer's operators too)
    +comm     the planner's step; the roofline plus all of the planner's communication, in the
              micro-batches and per step (the issue's "RuntimeEstimator plus its own communication
              model")

Each at two pricings of the roofline: matmuls at the GPU's peak (RuntimeEstimator's) and at the rate
the hardware table says they reach (`Hardware.efficiency`, the planner's): an order that weighs
compute against communication moves with that rate, and the planner's own is the second. The five
best are often within a few percent of each other, where one swapped pair costs Spearman 0.1: so
each order also gets a measure that ties do not sway, how much slower than the dry run's fastest
the planner's pick is by it (its regret); and the largest memory-part error (target 5%).

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
from nanolight.planner.hardware import Hardware, hardware  # noqa: E402
from nanolight.planner.layout import Layout  # noqa: E402
from nanolight.planner.memory import Workload, rank_memory  # noqa: E402
from nanolight.planner.search import plan  # noqa: E402
from nanolight.planner.timing import micro_batch_communication, micro_batch_work  # noqa: E402
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


# the roofline's matmuls at the GPU's peak (RuntimeEstimator's), at the table's rate (the planner's)
PRICINGS = ("peak", "table")
ORDERS = ("step", "compute", "+comm")  # the three measures compared, by the names the summary prints


def dry_run_compute(role: RoleReport, lay: Layout, pricing: str) -> float:
    """The dry run's compute estimate: its rank's roofline, stretched by the schedule's bubble."""
    seconds = role.compute_s if pricing == "peak" else role.table_compute_s
    return seconds / (1 - bubble_fraction(lay.accumulate_grad_batches, lay.pp, lay.pp_virtual))


def in_compute_talk(work: Workload, lay: Layout, hw: Hardware) -> float:
    """The planner's communication inside its compute part: its busiest stage's tp collectives, ring
    exchanges and pipeline messages (`timing.micro_batch_communication`), over the step's micro-batches
    and stretched by the bubble as `timing.step_time` stretches that stage's work."""
    works = [micro_batch_work(work, lay, hw, s) for s in range(lay.pp)]
    busiest = works.index(max(works))
    m = lay.accumulate_grad_batches
    return (
        m
        * micro_batch_communication(work, lay, hw, busiest)
        / (1 - bubble_fraction(m, lay.pp, lay.pp_virtual))
    )


def regret(planned: list[float], measured: list[float]) -> float:
    """How much slower than the measured fastest the planner's pick measures (0: it is the fastest)."""
    return measured[planned.index(min(planned))] / min(measured) - 1


def compare(name: str, top: int, gpu: str) -> tuple[dict[tuple[str, str], tuple[float, float]], float]:
    """Print the config's table; per (pricing, order) the Spearman of the planner's order against the
    dry run's and the planner's pick's `regret`, and the largest memory-part error."""
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
    planned: dict[str, list[float]] = {order: [] for order in ORDERS}
    measured: dict[tuple[str, str], list[float]] = {(p, o): [] for p in PRICINGS for o in ORDERS}
    worst = 0.0
    for i, prediction in enumerate(best, 1):
        lay = prediction.layout
        stage = max(range(lay.pp), key=lambda s: rank_memory(work, lay, s)["total"])
        ours = rank_memory(cpu_work, lay, stage)
        started = time.perf_counter()
        (role,) = dry_run(apply_layout(base, lay), stages=[stage]).roles
        seconds = time.perf_counter() - started
        print(f"[{i}] {describe(lay)}: pp stage {stage} (rank {role.rank}), dry run {seconds:.0f} s")
        print(f"    {'part':<36}{'planner GiB':>12}{'dry run GiB':>12}{'ratio':>8}")
        for label, mine, theirs in PARTS:
            p, d = sum(ours[k] for k in mine), sum(role.parts[k] for k in theirs)
            ratio = p / d if d else float("nan") if p else 1.0
            if d >= 2**20:  # parts under a MiB (a bf16-master rank's): not an error worth a ratio
                worst = max(worst, abs(ratio - 1))
            print(f"    {label:<36}{p / GIB:>12.3f}{d / GIB:>12.3f}{ratio:>8.3f}")
        p, d = ours["total"], role.peak
        print(f"    {'peak':<36}{p / GIB:>12.3f}{d / GIB:>12.3f}{p / d:>8.3f}", end="")
        print(
            f"   (planner, GPU kernels and allocator allowance: {prediction.memory_bytes['total'] / GIB:.3f})"
        )
        parts, talk = prediction.step_parts, in_compute_talk(work, lay, hw)
        step_talk = sum(
            parts[k] for k in ("pipeline_fill", "step_collectives", "dp_reduce_exposed", "zero_all_gather")
        )
        planned["step"].append(prediction.step_time_s)
        planned["compute"].append(parts["compute"] + parts["bubble"] - talk + parts["optimizer"])
        planned["+comm"].append(prediction.step_time_s)
        for pricing in PRICINGS:
            roofline = dry_run_compute(role, lay, pricing)
            measured[pricing, "step"].append(roofline + role.comm_s)
            measured[pricing, "compute"].append(roofline)
            measured[pricing, "+comm"].append(roofline + talk + step_talk)
        print(
            f"    step s: planner {prediction.step_time_s:.3f} (compute {parts['compute']:.3f} of which "
            f"communication {talk:.3f}, bubble {parts['bubble']:.3f}); dry run roofline {role.compute_s:.3f} "
            f"at the peak, {role.table_compute_s:.3f} at the table's rate ({role.flops / 1e12:.1f} TFLOP); "
            f"collectives {role.comm_s:.3f}",
            flush=True,
        )
    results = {
        (pricing, order): (
            spearman(planned[order], measured[pricing, order]),
            regret(planned[order], measured[pricing, order]),
        )
        for pricing in PRICINGS
        for order in ORDERS
    }
    print(f"== {name}: largest memory-part error {worst:.1%}; {summary(results)}")
    return results, worst


def summary(results: dict[tuple[str, str], tuple[float, float]]) -> str:
    """Spearman and the pick's regret per order, at each pricing, on one line."""
    return "; ".join(
        f"{pricing}: "
        + ", ".join(
            f"{order} {results[pricing, order][0]:.2f} ({results[pricing, order][1]:.1%})" for order in ORDERS
        )
        for pricing in PRICINGS
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--top", type=int, default=5, help="the planner's best layouts that fit, per config")
    parser.add_argument("--gpu", default="h100-sxm", help="planner/hardware.py's table name")
    args = parser.parse_args()
    results = {name: compare(name, args.top, args.gpu) for name in args.configs}
    print("Spearman of the planner's order against the dry run's (the pick's regret): step, compute alone, ")
    print(
        "and the roofline plus the planner's communication; the roofline's matmuls at the peak, at the table's rate"
    )
    for name, (result, worst) in results.items():
        print(f"{name:>16}: {summary(result)}; largest memory-part error {worst:.1%}")
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"host: peak resident set {peak_rss:.2f} GiB")


if __name__ == "__main__":
    main()
