"""Every valid layout of a model on a cluster, predicted and ranked: the planner's front door.

`plan` enumerates tp x cp x pp (schedule, virtual stages) x dp x ZeRO x recompute x micro-batch x
precision for a world of `gpus` ranks and a global batch of `global_batch_tokens`, keeps the
layouts the trainer would accept (`Layout.check`), predicts each one's peak memory per rank
(`memory.py`) and step time (`timing.py`), and sorts them: layouts that fit first, fastest first,
the smaller peak memory first among equally fast ones (the time model gives micro-batch size no
speed of its own: a matmul's efficiency is one calibrated figure).
Knobs the user pinned (`fixed`) are not varied. tp stays inside a node (its collectives are in
the critical path of every block); sequence parallelism is always on with tp > 1 (the same bytes
moved as plain tp, 1/tp of the norms' activations). cp is tried where the sequence splits into
2*cp equal chunks (zigzag); its ranks share their sequences, so dp alone divides the batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace
from typing import Any

from nanolight.errors import UsageError
from nanolight.models.llama_config import flops_per_token
from nanolight.planner.hardware import Hardware
from nanolight.planner.layout import Layout
from nanolight.planner.memory import Workload, peak_memory
from nanolight.planner.probes import stop_probe_ranks
from nanolight.planner.timing import step_time

GPU_PRECISIONS = ("bf16-mixed", "bf16-master")
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
VIRTUAL_STAGES = (2, 4)


@dataclass(frozen=True)
class Prediction:
    """One layout with its predicted figures."""

    layout: Layout
    memory_bytes: dict[str, int]
    step_parts: dict[str, float]
    tokens_per_s: float
    mfu: float
    fits: bool

    @property
    def step_time_s(self) -> float:
        return self.step_parts["total"]

    def as_dict(self) -> dict[str, Any]:
        """The `--json` record: the layout's fields plus the predictions."""
        return {
            **self.layout.as_dict(),
            "memory_bytes": self.memory_bytes,
            "step_time_s": self.step_time_s,
            "step_time_parts_s": self.step_parts,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "fits": self.fits,
        }


def predict(work: Workload, layout: Layout, hw: Hardware) -> Prediction:
    memory = peak_memory(work, layout)
    capacity = hw.memory_bytes if not hw.shared_cores else hw.memory_bytes // layout.world_size
    fits = memory["total"] <= capacity
    # hardware at hand times only what could run on it: a layout that does not fit gets the FLOP count
    step = step_time(work, layout, hw if fits else replace(hw, profiled=False))
    tokens = layout.sequences_per_step * work.seq_len
    achieved = flops_per_token(work.config, work.seq_len) * tokens / step["total"]
    mfu = achieved / (layout.world_size * hw.flops(layout.precision))
    return Prediction(layout, memory, step, tokens / step["total"], mfu, fits)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    work: Workload, gpus: int, sequences: int, hw: Hardware, fixed: dict[str, Any]
) -> list[Layout]:
    """Every layout of `gpus` ranks for a global batch of `sequences` the trainer accepts."""
    names = {f.name for f in fields(Layout)} - {"timeout_s"}  # a run's, not a layout's
    unknown = sorted(set(fixed) - names)
    if unknown:
        raise UsageError(f"cannot pin {unknown}: the layout's knobs are {sorted(names)}")

    def options(name: str, default: Any) -> tuple:
        return (fixed[name],) if name in fixed else tuple(default)

    precisions = options("precision", GPU_PRECISIONS if hw.device == "cuda" else ("32-true",))
    derived = ("dp", "pp_schedule", "pp_virtual", "accumulate_grad_batches")  # pinned: filtered below
    out = []
    degrees = [
        (tp, cp, pp)
        for tp in options("tp", [d for d in _divisors(gpus) if d <= hw.gpus_per_node])
        for cp in options("cp", [d for d in _divisors(gpus) if d == 1 or work.seq_len % (2 * d) == 0])
        for pp in options("pp", _divisors(gpus))
    ]
    for tp, cp, pp in degrees:
        if gpus % (tp * cp * pp) or sequences % (gpus // (tp * cp * pp)):
            continue
        dp = gpus // (tp * cp * pp)
        schedules = [("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("afab", 1)]
        schedules += [("interleaved_1f1b", v) for v in VIRTUAL_STAGES] if pp > 1 else []
        per_replica = sequences // dp
        knobs = itertools.product(
            schedules,
            options("zero_stage", (0, 1) if dp * cp > 1 else (0,)),
            options("activation_checkpointing", ("none", "selective", "full")),
            [m for m in options("micro_batch_size", MICRO_BATCH_SIZES) if per_replica % m == 0],
            precisions,
        )
        for (schedule, virtual), zero, ac, micro, precision in knobs:
            layout = Layout(
                tp=tp,
                pp=pp,
                dp=dp,
                pp_schedule=schedule,
                pp_virtual=virtual,
                zero_stage=zero,
                cp=cp,
                sequence_parallel=fixed.get("sequence_parallel", tp > 1) and tp > 1,
                activation_checkpointing=ac,
                micro_batch_size=micro,
                accumulate_grad_batches=per_replica // micro,
                precision=precision,
            )
            pinned = all(getattr(layout, k) == fixed[k] for k in derived if k in fixed)
            if pinned and layout.is_valid(work.config, work.seq_len):
                out.append(layout)
    return out


def plan(
    work: Workload, gpus: int, global_batch_tokens: int, hw: Hardware, fixed: dict[str, Any] | None = None
) -> list[Prediction]:
    """Predictions for every valid layout: those that fit first, then by step time."""
    if gpus < 1:
        raise UsageError(f"+cluster.gpus={gpus} must be a positive number of GPUs")
    if global_batch_tokens % work.seq_len:
        raise UsageError(
            f"+plan.global_batch_tokens={global_batch_tokens} is not a multiple of trainer.seq_len={work.seq_len}; "
            f"use e.g. {max(1, global_batch_tokens // work.seq_len) * work.seq_len}"
        )
    sequences = global_batch_tokens // work.seq_len
    layouts = candidate_layouts(work, gpus, sequences, hw, fixed or {})
    if not layouts:
        raise UsageError(
            f"no layout of {gpus} GPUs runs this model with {sequences} sequences per step: the data-parallel "
            "degree must divide the sequences and tp the heads and vocabulary; change +cluster.gpus or "
            "+plan.global_batch_tokens, or pin fewer knobs"
        )
    try:
        predictions = [predict(work, layout, hw) for layout in layouts]
    finally:
        stop_probe_ranks()  # on hardware at hand: the ranks that timed tp blocks
    predictions.sort(key=lambda p: (not p.fits, float(f"{p.step_time_s:.6g}"), p.memory_bytes["total"]))
    return predictions


def no_fit_message(predictions: list[Prediction], hw: Hardware, gpus: int, seq_len: int) -> str:
    """One line: the smallest per-rank memory any layout needs, and the knob that would help."""
    smallest = min(predictions, key=lambda p: p.memory_bytes["total"])
    parts, layout = smallest.memory_bytes, smallest.layout
    states = parts["parameters"] + parts["gradients"] + parts["optimizer_state"]
    held = parts["activations"] + parts["communication"] + parts["transient"]
    knobs = []
    if states > held:
        knobs.append("more GPUs (model states shard over pp, tp and, under ZeRO-1, dp x cp)")
        if layout.zero_stage == 0 and layout.replicas > 1:
            knobs.append("+parallel.zero_stage=1")
    else:
        if layout.activation_checkpointing != "full":
            knobs.append("trainer.activation_checkpointing=full")
        knobs.append(f"a shorter sequence than trainer.seq_len={seq_len}")
        knobs.append("more GPUs for tp/cp/pp")
    gb = 1e9
    return (
        f"no layout fits {gpus} x {hw.name} ({hw.memory_bytes / gb:.1f} GB each): the smallest needs "
        f"{parts['total'] / gb:.1f} GB per rank ({layout.overrides()}; model states {states / gb:.1f} GB, "
        f"activations and buffers {held / gb:.1f} GB); try {', or '.join(knobs)}"
    )
