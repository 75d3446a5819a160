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

from nanolight.models.llama_config import LlamaConfig, stage_costs
from nanolight.parallel.pipeline.schedules import bubble_fraction, check_micro_batches
from nanolight.planner.hardware import HARDWARE
from nanolight.planner.layout import Layout
from nanolight.planner.memory import (
    Workload,
    block_activation_bytes,
    chunk_activation_bytes,
    chunk_layers,
    head_transient_bytes,
    rank_memory,
    rank_parameters,
    ring_transient_bytes,
    schedule_peaks,
)
from nanolight.planner.search import candidate_layouts, plan
from nanolight.planner.timing import (
    ELEMENTWISE_BYTES,
    head_bytes,
    micro_batch_work,
    ring_block_bytes,
    step_time,
)

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
    args = "model=smollm-360m trainer.seq_len=4096 +cluster.gpus=8 +cluster.gpu=h100-sxm"
    out = _plan_cli(
        *args.split(), "+plan.global_batch_tokens=524288", "trainer.precision=bf16-mixed", "--json"
    )
    assert out.returncode == 0, out.stderr
    assert "max_position_embeddings=4096" in out.stderr  # beyond the preset's 2048: said, off stdout
    rows = json.loads(out.stdout)
    assert rows and all(r["precision"] == "bf16-mixed" for r in rows)  # the pinned knob is not varied
    keys = "tp pp pp_schedule pp_virtual cp dp zero_stage activation_checkpointing micro_batch_size"
    keys += " accumulate_grad_batches precision step_time_s mfu fits"
    for key in keys.split():
        assert key in rows[0], key
    for r in rows:
        parts = r["memory_bytes"]
        assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
        assert r["tp"] * r["pp"] * r["dp"] * r["cp"] == 8
        assert r["micro_batch_size"] * r["accumulate_grad_batches"] * r["dp"] * 4096 == 524288
        assert r["fits"] == (parts["total"] <= H100.memory_bytes)
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)  # fitting layouts first
    times = [r["step_time_s"] for r in rows if r["fits"]]
    # fastest first; times equal to 6 significant digits are a tie the smaller peak wins (`search.plan`)
    rounded = [float(f"{t:.6g}") for t in times]
    assert rounded == sorted(rounded)


def test_plan_script_table_and_no_fit_line() -> None:
    args = "model=smollm-1.7b +cluster.gpus=1 +cluster.gpu=a100-40gb +plan.global_batch_tokens=65536"
    out = _plan_cli(
        *args.split(),
        "trainer.seq_len=2048",
        "trainer.micro_batch_size=16",
        "trainer.activation_checkpointing=none",
    )
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
        assert lay.tp * lay.pp * lay.dp * lay.cp == 8 and lay.sequences_per_step == 64
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
        # sent tensors alive at once: the in-flight outputs sent on (kept for their backward) and
        # the gradients sent back whose batches the stage has not completed yet
        assert sent == [4, 4, 3, 1][stage] * boundary
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
    again by a recomputed forward), and ranks sharing cores keeping `concurrency` of the rate
    (but for the pipeline's bubble, where fewer ranks work)."""
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
    # in a pipeline's fill and drain one stage works, alone on the cores: at the rate it has alone
    pp2 = Layout(pp=2, accumulate_grad_batches=m)
    busiest = max(micro_batch_work(work, pp2, cpu, s) for s in range(2))
    idle = bubble_fraction(m, 2, 1)
    assert step_time(work, pp2, cpu)["bubble"] == pytest.approx(m * busiest * idle / (1 - idle) * 0.5)


def test_a_gpu_at_hand_floors_each_block_at_its_host_cost() -> None:
    """On a GPU the host issues kernels while earlier ones run: a block takes its FLOPs' time or
    the host's cost of issuing it, whichever is longer (not their sum, as on a CPU). The floor is
    what makes a larger micro-batch faster for a small model: without it only the per-micro-batch
    gradient accumulation sets them apart."""
    work = Workload(LlamaConfig.preset("smollm-135m"), 2048, "cuda")
    layers = work.config.num_hidden_layers
    floor = dataclasses.replace(H100, block_overhead=1e-3)
    one, eight = (
        Layout(micro_batch_size=m, accumulate_grad_batches=16 // m, precision="bf16-master") for m in (1, 8)
    )
    flops = micro_batch_work(work, one, H100, 0)  # the table alone: FLOPs at the efficiency
    assert flops < layers * 1e-3 < micro_batch_work(work, eight, H100, 0)  # the floor binds only at one
    assert micro_batch_work(work, one, floor, 0) == pytest.approx(layers * 1e-3)
    assert micro_batch_work(work, eight, floor, 0) == pytest.approx(micro_batch_work(work, eight, H100, 0))
    recompute = dataclasses.replace(one, activation_checkpointing="full")
    assert micro_batch_work(work, recompute, floor, 0) == pytest.approx(layers * 1e-3 * 4 / 3)
    fixed = {"precision": "bf16-master", "activation_checkpointing": "none"}
    # the table alone: micro-batch sizes differ by the bytes each micro-batch moves per weight
    # (gradient accumulation) and by the head's per micro-batch and per loss chunk only
    by_size = {p.layout.micro_batch_size: p.step_time_s for p in plan(work, 1, 16 * 2048, H100, fixed)}
    accumulate = ELEMENTWISE_BYTES["bf16-master", "none"][2] * stage_costs(work.config)[0] * layers
    sixteen = dataclasses.replace(one, micro_batch_size=16, accumulate_grad_batches=1)
    head = 16 * head_bytes(work, one) - head_bytes(work, sixteen)
    assert by_size[1] - by_size[16] == pytest.approx((15 * accumulate + head) / H100.memory_bandwidth)
    assert plan(work, 1, 16 * 2048, floor, fixed)[0].layout.micro_batch_size > 1


def test_at_hand_measures_the_host_cost_on_the_device() -> None:
    """`at_hand` keeps the table's figures and adds the host's cost of a tiny block's forward and
    backward on the device (here the CPU: the code path a GPU takes, but for its sync)."""
    import torch

    from nanolight.planner.hardware import at_hand

    hw = at_hand(H100, torch.device("cpu"))
    assert 0 < hw.block_overhead < 0.5
    assert dataclasses.replace(hw, block_overhead=0.0) == H100


def test_more_ranks_than_cores_share_out_the_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """With more ranks than cores a rank waiting for its pipeline peer gives its core to a busy
    one: the cores never idle, and the step's compute is every stage's work shared out -- unless
    the busiest stage, with the cores to itself, takes longer. (bench_planner, tp2 x pp2 on two
    cores: the busiest stage's path predicted 0.92-1.61x the measured step over 8 rounds, the
    shared-out work 0.66-0.95x over 3.)"""
    from nanolight.planner import timing

    work = Workload(LlamaConfig.preset("smollm-tiny"), 128, "cpu")
    cpu = dataclasses.replace(H100, device="cpu", shared_cores=2, concurrency=1.0, latency=0.0, profiled=True)
    m = 4
    idle = bubble_fraction(m, 2, 1)
    stage_work = {0: 2.0, 1: 3.0}  # seconds per micro-batch, every rank busy (half a core each)
    monkeypatch.setattr(timing, "micro_batch_work", lambda work, layout, hw, stage: stage_work[stage])
    four = Layout(tp=2, pp=2, accumulate_grad_batches=m, precision="32-true")  # four ranks, two cores
    parts = step_time(work, four, cpu)
    assert parts["compute"] == pytest.approx(m * (2.0 + 3.0) / 2) and parts["bubble"] == 0.0
    # lopsided stages: the busy stage alone at a core per rank (twice the rate) is the longer path
    stage_work[0] = 0.1
    parts = step_time(work, four, cpu)
    critical = m * 3.0 * 0.5 / (1 - idle)
    assert parts["compute"] + parts["bubble"] == pytest.approx(critical)
    # two ranks on two cores: an idle rank's core stays idle (one thread each), the bubble shows
    two = Layout(pp=2, accumulate_grad_batches=m, precision="32-true")
    parts = step_time(work, two, cpu)
    assert parts["compute"] == pytest.approx(m * 3.0)
    assert parts["bubble"] == pytest.approx(m * 3.0 * idle / (1 - idle))


def test_profiled_hardware_times_the_rank_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hardware at hand (`profiled`) times compute instead of counting FLOPs: per micro-batch, the
    rank's blocks as `probes.block_seconds` measures one in this process, over the rank's core
    share (no tp), or as `probes.rank_block_seconds` measures the tp block in as many ranks as
    share the cores in the run (up to `MAX_RANKS`, the rest scaled), with its collectives (so they
    are not counted again; the embedding's, the head's and the loss's are); the head on the last
    stage, over the core share. The probes themselves are checked in `test_planner_probes.py`."""
    from nanolight.planner import timing

    calls: list[tuple] = []

    def block(config: LlamaConfig, batch: int, seq_len: int, mode: str, precision: str) -> float:
        calls.append((batch, seq_len, mode, precision))
        return 0.010

    def in_ranks(config: LlamaConfig, batch: int, seq_len: int, tp: int, *rest: object) -> float:
        calls.append((batch, seq_len, tp, *rest))
        return 0.020

    monkeypatch.setattr(timing, "block_seconds", block)
    monkeypatch.setattr(timing, "rank_block_seconds", in_ranks)
    monkeypatch.setattr(timing, "head_seconds", lambda config, tokens, tp, precision: 0.003 * tokens / 512)
    work = Workload(LlamaConfig.preset("smollm-tiny"), 128, "cpu")
    cpu = dataclasses.replace(H100, device="cpu", shared_cores=2, concurrency=1.0, latency=0.0, profiled=True)
    layers = work.config.num_hidden_layers
    one = Layout(micro_batch_size=4, activation_checkpointing="full", precision="32-true")
    assert micro_batch_work(work, one, cpu, 0) == pytest.approx(layers * 0.010 + 0.003)
    assert calls[-1] == (4, 128, "full", "32-true")
    dp2 = dataclasses.replace(one, dp=2)  # two ranks on two cores: a core each, the block alone
    assert micro_batch_work(work, dp2, cpu, 0) == pytest.approx(layers * 0.010 + 0.003)
    assert calls[-1] == (4, 128, "full", "32-true")
    dp4 = dataclasses.replace(one, dp=4)  # four ranks on two cores: half a core each
    assert micro_batch_work(work, dp4, cpu, 0) == pytest.approx(2 * (layers * 0.010 + 0.003))
    # tp: the block in 2 ranks, the head's shard; of the collectives only the embedding's, the
    # head's and the loss's are charged (here latency only: 1 ms each)
    cpu_ms = dataclasses.replace(cpu, latency=1e-3, intra_node_bandwidth=1e15, link_efficiency=1.0)
    tp2 = dataclasses.replace(one, tp=2, sequence_parallel=True)
    outside = sum(n for n, _, _ in timing.tp_collectives(work, tp2, 0, blocks=False))
    assert outside == 1 + 2 + 1  # embedding; the head's input gathered and its gradient; the loss's chunk
    assert micro_batch_work(work, tp2, cpu_ms, 0) == pytest.approx(
        layers * 0.020 + 0.003 + outside * 1e-3, rel=1e-6
    )
    assert calls[-1] == (4, 128, 2, True, "full", "32-true", 2)
    # tp2 x dp2: four ranks on two cores, probed as four (the block as timed; the head at half a
    # core); a world past MAX_RANKS is probed at MAX_RANKS and scaled by the cores it shares
    tp2dp2 = dataclasses.replace(tp2, dp=2)
    assert micro_batch_work(work, tp2dp2, cpu, 0) == pytest.approx(layers * 0.020 + 0.003 * 2, rel=1e-3)
    assert calls[-1][-1] == 4
    tp2dp16 = dataclasses.replace(tp2, dp=16)
    assert micro_batch_work(work, tp2dp16, cpu, 0) == pytest.approx(layers * 0.080 + 0.003 * 16, rel=1e-3)
    assert calls[-1][-1] == timing.MAX_RANKS == 8
    pp2 = dataclasses.replace(one, pp=2)
    first = sum(len(r) for r in chunk_layers(work.config, pp2)[0])
    # a core each; no head on stage 0; its activation messages cost bytes / link (microseconds)
    assert micro_batch_work(work, pp2, cpu, 0) == pytest.approx(first * 0.010, rel=1e-3)
    assert calls[-1] == (4, 128, "full", "32-true")


def test_context_parallel_terms() -> None:
    """cp splits each sequence: a rank's activations are those of T/cp tokens, plus ring
    attention's fp32 output accumulator; ZeRO-1 shards over dp x cp; the ring passes K/V (compute
    dtype) and dK/dV sums (the same) of the rank's tokens and kv heads, and its sends cost latency +
    bytes / link each: cp-1 forward, 2 (cp-1) backward when no compute hides them."""
    config = dataclasses.replace(LlamaConfig.preset("smollm-360m"), max_position_embeddings=16384)
    T, q, kv = (
        16384,
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    long, half = Workload(config, T), Workload(config, T // 2)
    cp2 = Layout(cp=2)
    ring_out = 4 * (T // 2) * q  # the fp32 output accumulator the ring saves (sdpa saves the bf16 one only)
    assert block_activation_bytes(long, cp2) == block_activation_bytes(half, Layout()) + ring_out
    assert 0.5 < block_activation_bytes(long, cp2) / block_activation_bytes(long, Layout()) < 0.6
    one, two = rank_memory(long, Layout(), 0), rank_memory(long, cp2, 0)
    assert two["activations"] < 0.6 * one["activations"]
    assert ring_transient_bytes(long, cp2) > 0 == ring_transient_bytes(long, Layout())
    # a block's backward (the ring's buffers) or the forward's end (the fused head's logits chunk)
    assert two["transient"] == max(ring_transient_bytes(long, cp2), head_transient_bytes(long, cp2, 0))
    zero = Layout(cp=2, dp=2, zero_stage=1)
    assert rank_memory(long, zero, 0)["optimizer_state"] == 12 * rank_parameters(config, zero, 0) // 4

    elements = 2 * (T // 4) * kv  # K and V of T/cp tokens at cp=4, bf16 under bf16-mixed
    assert ring_block_bytes(long, Layout(cp=4)) == 2 * elements
    # nothing to hide the ring behind: no time for FLOPs or the elementwise kernels' bytes
    instant = dataclasses.replace(H100, bf16_flops=1e30, memory_bandwidth=1e30, latency=1e-5)
    send = 1e-5 + 2 * elements / instant.link(4)
    per_block = 3 * send + 3 * send + 3 * send  # K/V forward, K/V backward, dK/dV home: cp-1 each
    assert micro_batch_work(long, Layout(cp=4), instant, 0) == pytest.approx(
        config.num_hidden_layers * per_block, rel=1e-3
    )


def test_search_proposes_cp_where_only_it_fits() -> None:
    """A two-million-token sequence of smollm-360m fits 16 H100s only split over a cp ring (its
    15 heads leave tp at 1; pp alone keeps a whole sequence's activations per stage). Half a
    million tokens fit pp 8 since the last stage's loss holds no (tokens x vocabulary) softmax."""
    T = 2**21
    config = dataclasses.replace(LlamaConfig.preset("smollm-360m"), max_position_embeddings=T)
    work = Workload(config, T)
    without = plan(work, 16, 2 * T, H100, {"precision": "bf16-mixed", "cp": 1})
    assert not any(p.fits for p in without)
    best = plan(work, 16, 2 * T, H100, {"precision": "bf16-mixed"})[0]
    assert best.fits and best.layout.cp > 1 and best.layout.world_size == 16
    assert f"+parallel.cp={best.layout.cp}" in best.layout.overrides()
    assert not Layout(cp=3).is_valid(config, T)  # 2**21 is not divisible by 2 * 3
