"""Activation checkpointing (`parallel/blocks.py`) changes no number and saves memory.

Losses with and without it are equal to 1e-6 (recomputation re-runs the same ops on the same
inputs) at every layout: one process and tp2 here, the rest of the matrix (sequence parallel,
pp 1F1B, dp ZeRO-1, tp x pp, pp x dp) marked slow. The memory check counts bytes, not time.
"""

from __future__ import annotations

import _tiny as tiny
import pytest
import torch
from _dist import run_distributed
from torch.profiler import ProfilerActivity, profile

from nanolight import NanoTrainer
from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.parallel.blocks import apply_activation_checkpointing
from nanolight.strategies import Parallel3DStrategy, SingleDeviceStrategy

SEED, STEPS, ACCUM, MICRO, T = 7, 3, 2, 2, 16
MODES = [("full", 1), ("selective", 1), ("full", 2)]


def fit_losses(strategy_cls: type, attn: str = "eager", **kwargs) -> list[float]:
    """The step losses of a short run (3 steps x 2 micro-batches, gradient clipping)."""
    trainer = NanoTrainer(
        use_distributed_sampler=False,  # every rank is given the same loader, as one process
        max_steps=STEPS, accumulate_grad_batches=ACCUM, gradient_clip_val=0.5, strategy=strategy_cls(**kwargs),
        seed=SEED, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        callbacks=[losses := tiny.StepLosses()],
    )  # fmt: skip
    module = tiny.TinyLM(tiny.tiny_config(layers=4, attn_implementation=attn), seed=SEED)
    trainer.fit(module, train_dataloaders=tiny.token_loader(STEPS * ACCUM * MICRO, T, batch_size=MICRO))
    return losses.losses


def _assert_same(losses: dict, reference: str = "none") -> None:
    for name, values in losses.items():
        assert len(values) == STEPS
        torch.testing.assert_close(
            torch.tensor(values), torch.tensor(losses[reference]), rtol=0, atol=1e-6, msg=name
        )


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_one_process_losses_equal_without_and_with_recompute(attn: str) -> None:
    losses = {"none": fit_losses(SingleDeviceStrategy, attn, device="cpu")}
    for mode, every in MODES:
        losses[f"{mode}/{every}"] = fit_losses(
            SingleDeviceStrategy, attn, device="cpu", activation_checkpointing=mode,
            activation_checkpointing_every=every,
        )  # fmt: skip
    _assert_same(losses)


def test_recompute_keeps_names_and_marks_the_chosen_blocks() -> None:
    model = LlamaForCausalLM(tiny.tiny_config(layers=4))
    keys = list(model.state_dict())
    assert apply_activation_checkpointing(model, "full", every=2) == [0, 2]
    assert list(model.state_dict()) == keys
    with pytest.raises(RuntimeError, match="already has activation checkpointing"):
        apply_activation_checkpointing(model, "selective")
    with pytest.raises(TypeError, match="pp_plan"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "full")


def activation_bytes(mode: str, every: int = 1) -> int:
    """Bytes allocated by one training forward and still held when backward starts (the CPU
    profiler's allocations minus frees): everything saved for backward, recompute caches included."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.preset("smollm-tiny"))
    apply_activation_checkpointing(model, mode, every)
    ids = torch.randint(0, 8192, (4, 256), generator=torch.Generator().manual_seed(1))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(ids, labels=ids)
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    loss.backward()
    return held


def test_recompute_saves_activation_memory() -> None:
    none, full, selective = (activation_bytes(m) for m in ("none", "full", "selective"))
    every_2nd = activation_bytes("full", 2)
    assert full <= 0.3 * none  # the target for full (smollm-tiny, B=4, T=256)
    assert full < selective < none and full < every_2nd < none


# ---------------------------------------------------------------------------- parallel layouts
def _layout_losses(rank: int, world: int, layout: dict, modes: list) -> dict:
    losses = {"none": fit_losses(Parallel3DStrategy, **layout)}
    for mode, every in modes:
        losses[f"{mode}/{every}"] = fit_losses(
            Parallel3DStrategy, activation_checkpointing=mode, activation_checkpointing_every=every, **layout
        )
    return losses


LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2-1f1b": dict(pp=2, pp_schedule="1f1b"),
    "dp2-zero1": dict(dp=2, zero_stage=1),
    "tp2-pp2-sp": dict(tp=2, pp=2, sequence_parallel=True),
    "pp2-dp2-zero1": dict(pp=2, dp=2, zero_stage=1),
}


@pytest.mark.parametrize(
    "name", [n if n == "tp2" else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS]
)
def test_parallel_losses_equal_without_and_with_recompute(name: str) -> None:
    layout = LAYOUTS[name]
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
    modes = MODES if name == "tp2" else MODES[:2]
    out = run_distributed(_layout_losses, world, layout, modes, timeout=600, pg_timeout=120)
    for rank_losses in out:
        _assert_same(rank_losses)
