"""The layout planner's front door and its bookkeeping (no processes; the memory model is checked
against real runs in `test_planner_memory.py`).

- `scripts/plan.py` composes the recipe's config, prints the table, `--json` rows with the
  documented fields, best first; a model that fits nowhere is one line naming the knob.
- The enumeration lists exactly what the trainer accepts (its own checks refuse the rest).
- Activations follow the schedule itself: 1F1B keeps p - s micro-batches on stage s, AFAB all
  m, interleaving a few more chunks; the bubble is the schedule's (p-1)/(v*m+p-1).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanolight.models.llama_config import LlamaConfig
from nanolight.parallel.pipeline.schedules import bubble_fraction, check_micro_batches
from nanolight.planner.hardware import HARDWARE
from nanolight.planner.layout import Layout
from nanolight.planner.memory import (
    SEND_BOUND_GRADIENTS,
    Workload,
    chunk_activation_bytes,
    rank_memory,
    schedule_peaks,
)
from nanolight.planner.search import candidate_layouts, plan
from nanolight.planner.timing import micro_batch_work, step_time

ROOT = Path(__file__).resolve().parents[1]
H100 = HARDWARE["h100-sxm"]


def _plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plan.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_plan_script_json_rows_best_first() -> None:
    out = _plan_cli(
        "model=smollm-360m", "trainer.seq_len=4096", "+cluster.gpus=8", "+cluster.gpu=h100-sxm",
        "+plan.global_batch_tokens=524288", "trainer.precision=bf16-mixed", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "max_position_embeddings=4096" in out.stderr  # beyond the preset's 2048: said, off stdout
    rows = json.loads(out.stdout)
    assert rows and all(r["precision"] == "bf16-mixed" for r in rows)  # the pinned knob is not varied
    for key in ("tp", "pp", "pp_schedule", "pp_virtual", "cp", "dp", "zero_stage", "activation_checkpointing",
                "micro_batch_size", "accumulate_grad_batches", "precision", "step_time_s", "mfu", "fits"):  # fmt: skip
        assert key in rows[0], key
    for r in rows:
        parts = r["memory_bytes"]
        assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
        assert r["tp"] * r["pp"] * r["dp"] == 8
        assert r["micro_batch_size"] * r["accumulate_grad_batches"] * r["dp"] * 4096 == 524288
        assert r["fits"] == (parts["total"] <= H100.memory_bytes)
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)  # fitting layouts first
    times = [r["step_time_s"] for r in rows if r["fits"]]
    assert all(a <= b * (1 + 1e-6) for a, b in zip(times, times[1:], strict=False))  # fastest first


def test_plan_script_table_and_no_fit_line() -> None:
    out = _plan_cli(
        "model=smollm-1.7b", "+cluster.gpus=1", "+cluster.gpu=a100-40gb", "+plan.global_batch_tokens=65536",
        "trainer.seq_len=2048", "trainer.micro_batch_size=16", "trainer.activation_checkpointing=none",
    )  # fmt: skip
    assert out.returncode != 0 and out.stdout == ""
    line = out.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "smallest needs" in line and "activation_checkpointing=full" in line, line

    out = _plan_cli(
        "model=smollm-135m", "+cluster.gpus=4", "+cluster.gpu=a100-80gb", "+plan.global_batch_tokens=262144"
    )
    assert out.returncode == 0, out.stderr
    assert "valid layouts on 4 x a100-80gb" in out.stdout and out.stdout.strip().splitlines()[-1].startswith(
        "best:"
    )


def test_enumeration_lists_what_the_trainer_accepts() -> None:
    config = LlamaConfig.preset("smollm-135m")  # 9 heads, 3 kv heads, 30 layers
    work = Workload(config, 2048)
    layouts = candidate_layouts(work, 8, 64, H100, {})
    assert layouts and all(lay.tp in (1,) for lay in layouts)  # tp must divide 3 kv heads and 9 heads: 1 only
    for lay in layouts:
        assert lay.tp * lay.pp * lay.dp == 8 and lay.sequences_per_step == 64
        if lay.pp > 1:
            check_micro_batches(lay.pp, lay.pp_schedule, lay.accumulate_grad_batches)  # the trainer's rule
    interleaved = {
        (lay.pp, lay.accumulate_grad_batches) for lay in layouts if lay.pp_schedule == "interleaved_1f1b"
    }
    assert all(m % p == 0 for p, m in interleaved) and interleaved
    with pytest.raises(ValueError, match="does not divide"):
        Layout(tp=2).check(config, 2048)


def test_activations_follow_the_schedule() -> None:
    config = LlamaConfig.preset("smollm-360m")
    work = Workload(config, 1024)
    m, p = 8, 4
    boundary = 1024 * config.hidden_size * 4  # one micro-batch's stage input (fp32 stream under bf16-mixed)
    for stage in range(p):
        lay = Layout(pp=p, accumulate_grad_batches=m)
        chunk = chunk_activation_bytes(work, lay, stage)[0]
        peak, sent = schedule_peaks(work, lay, stage)
        assert peak == ((p - stage) if stage < p - 1 else 1) * chunk  # 1F1B: stage s holds p - s
        # sends held: the in-flight outputs sent on (kept for their backward), plus at most two
        # gradients sent back before their completion is seen
        outputs = (p - stage) * boundary if stage < p - 1 else 0
        assert sent == outputs + (SEND_BOUND_GRADIENTS * boundary if stage > 0 else 0)
        afab = Layout(pp=p, pp_schedule="afab", accumulate_grad_batches=m)
        assert schedule_peaks(work, afab, stage)[0] == m * chunk  # AFAB: all m
    # recompute shrinks what each micro-batch keeps; ZeRO-1 shards the optimizer state
    full = rank_memory(work, Layout(activation_checkpointing="full"), 0)
    none = rank_memory(work, Layout(), 0)
    assert full["activations"] < none["activations"] / 4  # the fused loss's fp32 d weight stays
    assert (
        rank_memory(work, Layout(dp=8, zero_stage=1), 0)["optimizer_state"]
        == 12 * (none["optimizer_state"] // 8) // 8
    )


def test_step_time_carries_the_schedule_bubble() -> None:
    work = Workload(LlamaConfig.preset("smollm-360m"), 2048)
    for p, v, m in ((4, 1, 8), (4, 2, 8), (2, 1, 16)):
        schedule = "interleaved_1f1b" if v > 1 else "1f1b"
        lay = Layout(pp=p, pp_schedule=schedule, pp_virtual=v, accumulate_grad_batches=m)
        parts = step_time(work, lay, H100)
        busiest = max(micro_batch_work(work, lay, H100, s) for s in range(p))
        assert parts["compute"] == pytest.approx(m * busiest)
        assert parts["bubble"] / (parts["compute"] + parts["bubble"]) == pytest.approx(
            bubble_fraction(m, p, v)
        )
    predictions = plan(work, 8, 2**19, H100)
    assert predictions[0].fits and 0 < predictions[0].mfu < H100.efficiency


def test_cpu_host_costs_block_overhead_and_shared_cores() -> None:
    """The two costs a CPU adds to the FLOPs: a fixed host cost per block forward + backward (paid
    again by a recomputed forward), and ranks sharing cores keeping `concurrency` of the rate."""
    work = Workload(LlamaConfig.preset("smollm-tiny"), 128, "cpu")
    cpu = dataclasses.replace(H100, device="cpu", shared_cores=2, efficiency=1.0, concurrency=0.5)
    slow = dataclasses.replace(cpu, block_overhead=0.01)
    layers, m = work.config.num_hidden_layers, 4
    for recompute, factor in (("none", 1.0), ("full", 4 / 3)):
        lay = Layout(accumulate_grad_batches=m, activation_checkpointing=recompute)
        added = step_time(work, lay, slow)["compute"] - step_time(work, lay, cpu)["compute"]
        assert added == pytest.approx(m * layers * 0.01 * factor)
    one, dp2 = Layout(), Layout(dp=2)  # the same work per rank: two busy cores keep half the rate each
    assert micro_batch_work(work, dp2, cpu, 0) == pytest.approx(2 * micro_batch_work(work, one, cpu, 0))
