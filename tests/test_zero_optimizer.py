"""ZeRO-1 (`ZeroOptimizer`) steps exactly like ``torch.optim.AdamW`` on the whole model, holds 1/dp
of the optimizer state per rank, and its state dict is the single-device format (saved at one
dp, loaded at another)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _tiny import run_distributed, tiny_config

from nanolight.models import LlamaForCausalLM
from nanolight.parallel.zero import ZeroOptimizer

SEED, B, T, LR = 5, 2, 16, 1e-2
BUCKET = 16 * 1024  # bytes: several buckets for this tiny model


def tiny_model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(tiny_config())
    model.init_weights(torch.Generator().manual_seed(SEED))
    return model


def adamw_with_schedule(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
    """Weight-decay groups (matrices decay, norms do not) and a warm-up LR schedule."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    # eps=1e-6: with dp=4 the reduction adds the ranks' gradients in another order than the
    # reference's backward, and the default eps=1e-8 turns those last-bit differences of
    # near-zero gradients into visible weight differences (g / |g| flips); this tests the optimizer
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=LR, eps=1e-6
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def assert_weights_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """1e-5 relative on the tensor's norm, and no element off by more than 1e-6 (+1e-5 relative).

    Not bitwise: the dp reduction adds the ranks' gradients in another order than the
    reference's backward, and Adam's g / sqrt(v) turns last-bit differences of a near-zero
    gradient into ~1e-7 weight differences of single elements. A wrong update is ~lr = 1e-2.
    """
    rel = torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)
    assert rel <= 1e-5, f"{what}: relative error {rel:.3g}"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=what)


def batches(step: int, dp: int) -> torch.Tensor:
    """The global batch of `step`: dp micro-batches of (B, T) tokens."""
    return torch.randint(0, 128, (dp, B, T), generator=torch.Generator().manual_seed(100 + step))


def reference_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, ids: torch.Tensor
) -> None:
    opt.zero_grad()
    loss = torch.stack([model(x, labels=x) for x in ids]).mean()  # the dp mean, on one process
    loss.backward()
    opt.step()
    sched.step()


def zero_step(model: torch.nn.Module, zero: ZeroOptimizer, sched: object, ids: torch.Tensor) -> None:
    zero.zero_grad()
    x = ids[dist.get_rank()]
    model(x, labels=x).backward()
    zero.step()
    sched.step()


def _equals_adamw(rank: int, world: int, overlap: bool, out_dir: str) -> dict:
    ref = tiny_model()
    ref_opt, ref_sched = adamw_with_schedule(ref)
    model = copy.deepcopy(ref)
    opt, sched = adamw_with_schedule(model)
    zero = ZeroOptimizer(opt, dist.group.WORLD, bucket_bytes=BUCKET, overlap=overlap)
    for step in range(4):
        ids = batches(step, world)
        reference_step(ref, ref_opt, ref_sched, ids)
        zero_step(model, zero, sched, ids)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert_weights_close(p, q, f"{name} at step {step}")
    assert zero.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == zero.inner.param_groups[0]["lr"]

    # partition: every group's buckets padded to a multiple of dp, 1/dp of each per rank
    buckets = zero.reducer.buckets
    assert len(buckets) > 2 and all(b.numel % world == 0 for b in buckets)
    for b in buckets:
        unpadded = sum(p.numel() for p in b.params)
        assert b.numel - unpadded < world and (len(b.params) == 1 or unpadded * 4 <= BUCKET)
    for g, size in enumerate(zero.reducer.shard_sizes):
        assert size == sum(b.numel for b in buckets if b.group_index == g) // world
        assert zero.state[zero.master[g]]["exp_avg"].numel() == size
    assert zero.state_numel() == 2 * sum(zero.reducer.shard_sizes)

    # the full state dict is torch's single-device AdamW state dict
    sd = zero.state_dict()
    ref_sd = ref_opt.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"]
    assert sd["state"].keys() == ref_sd["state"].keys()
    for idx, entry in ref_sd["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(sd["state"][idx][key], value, rtol=1e-5, atol=1e-8)
    if rank == 0:
        torch.save({"optim": sd, "model": model.state_dict(), "ref_optim": ref_sd}, Path(out_dir) / "zero.pt")
    return {
        "numel": sum(p.numel() for p in model.parameters()),
        "padded": sum(b.numel for b in buckets),
        "state_numel": zero.state_numel(),
    }


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("overlap", [True, False], ids=["hooks", "in-step"])
def test_zero_matches_adamw_and_partitions_state(tmp_path: Path, world: int, overlap: bool) -> None:
    out = run_distributed(_equals_adamw, world, overlap, str(tmp_path), timeout=120)
    padded = out[0]["padded"]
    assert all(o["state_numel"] == 2 * padded // world for o in out)  # exactly 1/dp of 2 moments
    assert out[0]["numel"] <= padded < out[0]["numel"] + world * 64  # padding < dp per bucket


def _resume(rank: int, world: int, path: str) -> bool:
    saved = torch.load(Path(path) / "zero.pt", weights_only=True)
    ref = tiny_model()
    ref.load_state_dict(saved["model"])
    ref_opt, ref_sched = adamw_with_schedule(ref)
    ref_opt.load_state_dict(saved["ref_optim"])
    model = copy.deepcopy(ref)
    opt, sched = adamw_with_schedule(model)
    zero = ZeroOptimizer(opt, dist.group.WORLD, bucket_bytes=BUCKET)
    zero.load_state_dict(saved["optim"])  # saved at dp=2, loaded at dp=world
    for _ in range(4):  # the schedules restart alike on both sides; what matters is the moments
        ref_sched.step()
        sched.step()
    for step in range(4, 7):
        ids = batches(step, world)
        reference_step(ref, ref_opt, ref_sched, ids)
        zero_step(model, zero, sched, ids)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert_weights_close(p, q, name)
    return True


def test_zero_state_dict_round_trip_across_dp(tmp_path: Path) -> None:
    run_distributed(_equals_adamw, 2, True, str(tmp_path), timeout=120)
    assert run_distributed(_resume, 1, str(tmp_path), timeout=120) == [True]
    assert run_distributed(_resume, 4, str(tmp_path), timeout=120) == [True] * 4


def _three_steps(
    rank: int, world: int, ref: torch.nn.Module, ref_opt: Any, model: torch.nn.Module, zero: Any
) -> None:
    """The reference on the whole global batch, ZeRO on this rank's half: three steps."""
    for step in range(3):
        ids = batches(step, world)
        ref_opt.zero_grad()
        torch.stack([ref(x, labels=x) for x in ids]).mean().backward()
        ref_opt.step()
        zero.zero_grad()
        model(ids[rank], labels=ids[rank]).backward()
        zero.step()


def _sgd(rank: int, world: int) -> bool:
    ref = tiny_model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    zero = ZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01), dist.group.WORLD
    )
    _three_steps(rank, world, ref, ref_opt, model, zero)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert_weights_close(p, q, "sgd")
    return True


def test_zero_wraps_sgd() -> None:
    assert run_distributed(_sgd, 2, timeout=120) == [True, True]


def _kernels(rank: int, world: int, kernel: dict, path: str) -> bool:
    ref = tiny_model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=1e-6, **kernel)
    zero = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, **kernel), dist.group.WORLD)
    for key, value in kernel.items():  # the shards step with the kernel the user chose
        assert zero.inner.defaults[key] == value and all(g[key] == value for g in zero.inner.param_groups)
    _three_steps(rank, world, ref, ref_opt, model, zero)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert_weights_close(p, q, name)
    # a state saved by the plain for-loop AdamW (a CPU step count) loads into these kernels and steps
    plain = torch.optim.AdamW(copy.deepcopy(ref).parameters(), lr=LR)
    plain.load_state_dict(ref_opt.state_dict())
    zero.load_state_dict(plain.state_dict())
    zero.zero_grad()
    ids = batches(2, world)  # the last step's batches once more
    model(ids[rank], labels=ids[rank]).backward()
    zero.step()
    return True


@pytest.mark.parametrize("kernel", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_zero_steps_with_the_users_kernel(tmp_path: Path, kernel: dict) -> None:
    assert run_distributed(_kernels, 2, kernel, str(tmp_path), timeout=120) == [True, True]
