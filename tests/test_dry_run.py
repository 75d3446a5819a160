"""The dry run (`nanolight/pretrain/dry_run.py`) against facts: a rank's weights are its real
shards' bytes (a model built for real, cut by the same tp plan arithmetic), its traffic per step
is the code's (ZeRO-1: one reduce-scatter and one all-gather per bucket), and a layout that does
not fit says so in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nanolight.models.llama import LlamaConfig, LlamaForCausalLM
from nanolight.parallel.config import ParallelConfig
from nanolight.planner.hardware import hardware
from nanolight.planner.layout import Layout
from nanolight.planner.memory import Workload, rank_memory
from nanolight.pretrain.config import ClusterConfig, PretrainConfig, TrainConfig
from nanolight.pretrain.dry_run import DryRunReport, StepsMemTracker, dry_run, measured_fit
from nanolight.pretrain.run import build_strategy

pytestmark = pytest.mark.slow  # three fake ranks of 8: about a minute on 2 shared cores

TP_SPLIT = (
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "o_proj",
    "gate_up_proj",
    "down_proj",
    "embed_tokens",
    "lm_head",
)


def _config(tp: int, cp: int, dp: int, precision: str = "32-true") -> PretrainConfig:
    return PretrainConfig(
        trainer=TrainConfig(micro_batch_size=2, seq_len=64, accumulate_grad_batches=2, precision=precision),
        parallel=ParallelConfig(tp=tp, cp=cp, dp=dp, zero_stage=1),
        cluster=ClusterConfig(gpu="h100-sxm"),
    )


def _tp_shard_bytes(model_config: LlamaConfig, tp: int, element_size: int) -> int:
    """Bytes of one tp rank's parameters: every matrix (and the vocabulary) split tp ways, norms whole."""
    model = LlamaForCausalLM(model_config)  # real, on CPU
    total = 0
    for name, p in {id(p): (n, p) for n, p in model.named_parameters()}.values():
        split = any(part in name for part in TP_SPLIT)
        total += (p.numel() // tp if split else p.numel()) * element_size
    return total


@pytest.fixture(scope="module")
def report() -> DryRunReport:
    return dry_run(_config(tp=2, cp=2, dp=2))


def test_weights_are_the_real_shards(report: DryRunReport) -> None:
    (role,) = report.roles
    assert report.world == 8 and role.like == 8
    assert role.parts["weights"] == _tp_shard_bytes(LlamaConfig.preset("smollm-tiny"), 2, 4)


def test_zero1_traffic_per_step(report: DryRunReport) -> None:
    (role,) = report.roles
    steps = {m.step for m in role.messages}
    assert steps == {0, 1}
    for step in steps:
        ops = [(m.op, m.group) for m in role.messages if m.step == step]
        scatters = ops.count(("_reduce_scatter_base_", "replica"))
        assert scatters >= 1 and ops.count(("_allgather_base_", "replica")) == scatters
        assert ("send", "cp") in ops and ("allreduce_", "tp") in ops  # the ring, tp's collectives
    reduced = sum(m.nbytes for m in role.messages if m.step == 1 and m.op == "_reduce_scatter_base_")
    assert reduced >= role.parts["weights"]  # every gradient reduced once (fp32: the weights' bytes)


def test_does_not_fit_names_rank_part_and_amount(report: DryRunReport) -> None:
    (role,) = report.roles
    small = dataclasses.replace(report, memory_bytes=role.peak - 2**20)
    (line,) = small.misfits()
    part = max(role.parts, key=role.parts.get)
    assert line.startswith("rank 0 (pp0 tp0 cp0 dp0) does not fit a h100-sxm")
    assert f"largest part is {part}" in line and "0.00 GiB over" in line
    assert report.misfits() == []


def test_fake_memory_equals_a_real_runs() -> None:
    """One process, real tensors, the same measurement: the dry run's parts are the real run's."""
    config = _config(tp=1, cp=1, dp=1)
    hw = hardware("h100-sxm")
    memory, _, _ = measured_fit(config, build_strategy(config), hw, {})
    (role,) = dry_run(config).roles
    assert role.parts == memory.peak_parts()


def test_meta_tensors_hold_no_memory() -> None:
    """The strategy builds the model on "meta" before it materialises it: those tensors have no
    storage anywhere, and the tracker's meta device must not add their nominal bytes to a peak."""
    with StepsMemTracker() as memory:
        held = torch.empty(256)  # 1 KiB on the program's device
        nominal = torch.empty(2**20, device="meta")  # 4 MiB of nothing
    assert nominal.is_meta and sum(memory.peak_parts().values()) == held.untyped_storage().nbytes()


@pytest.mark.parametrize("precision", ["32-true", "bf16-master"])
def test_parts_match_the_planner(precision: str) -> None:
    """The planner held to the dry run (issue 37's target, at tiny size): weights, gradients and
    optimizer state equal, the rest within 5%. The planner's CPU workload, since the dry run runs
    this machine's kernels. The tracker files what the forward made under activations, the
    planner the head's last moment under transient: their sums at the peak are compared."""
    config = _config(tp=1, cp=1, dp=2, precision=precision)
    (role,) = dry_run(config).roles
    t = config.trainer
    layout = Layout(
        dp=2,
        zero_stage=1,
        precision=precision,
        micro_batch_size=t.micro_batch_size,
        accumulate_grad_batches=t.accumulate_grad_batches,
    )
    planned = rank_memory(Workload(config.model, t.seq_len, "cpu"), layout, 0)
    assert role.parts["weights"] == planned["parameters"]
    assert role.parts["gradients"] == planned["gradients"]
    assert role.parts["optimizer_state"] == pytest.approx(planned["optimizer_state"], abs=512)
    measured = role.parts["activations"] + role.parts["temporaries"] + role.parts["communication"]
    predicted = planned["activations"] + planned["transient"] + planned["communication"]
    assert measured == pytest.approx(predicted, rel=0.05)
