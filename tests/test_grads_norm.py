"""The global gradient norm: measured once per step however many ask (NaNGuard, then clipping), the
value torch's own `clip_grad_norm_` gives, and on the groups' device on a rank that counts nothing;
measured and clipped in a number of kernels that does not grow with the number of parameters
(a flat buffer's pieces as one), to fp32 rounding of an fp64 reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from _tiny import tiny_config
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nanolight.models import LlamaForCausalLM
from nanolight.parallel import ParallelContext
from nanolight.parallel.grads import GradientSync, clip_, global_norm
from nanolight.parallel.shard import replicated_layout
from nanolight.parallel.zero import ZeroOptimizer


def _norm_all_reduces(rank: int, world_size: int, zero_stage: int) -> dict[str, Any]:
    ctx = ParallelContext(dp=world_size)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    sync = GradientSync(model, replicated_layout(model, ctx), ctx, zero_stage=zero_stage)
    sync.wrap_optimizers([torch.optim.SGD(model.parameters(), lr=0.1)])
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    sync.require_sync(True)
    model(x).pow(2).sum().backward()
    sync.finish()

    calls = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        checked = sync.clip_(None)  # NaNGuard's look at the norm
        clipped = sync.clip_(0.5)  # then the trainer's clipping
        after = sync.clip_(None)  # the gradients changed: measured anew
    finally:
        dist.all_reduce = real
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]) if not zero_stage else None
    return {
        "norm_all_reduces": len([c for c in calls if c == ()]),
        "checked": float(checked), "clipped": float(clipped), "after": float(after),
        "full_after": None if grads is None else float(grads.norm()),
    }  # fmt: skip


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_norm_is_measured_once_for_nan_guard_and_clipping(zero_stage: int) -> None:
    for out in run_distributed(_norm_all_reduces, 2, zero_stage):
        # ZeRO-1: one all-reduce of the squares over dp per measurement (plain dp: none, the
        # reduced gradients are the same on every rank); the check and the clipping share one
        assert out["norm_all_reduces"] == (2 if zero_stage else 0)
        assert out["checked"] == out["clipped"] > 0.5
        assert out["after"] == pytest.approx(0.5, rel=1e-4)  # torch's coefficient: max_norm / (norm + 1e-6)
        if out["full_after"] is not None:
            assert out["after"] == pytest.approx(out["full_after"], rel=1e-6)


def test_a_rank_that_counts_nothing_joins_on_the_groups_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL refuses a CPU tensor: the zero a rank without counted gradients contributes must be on
    the device it is told (faked here as "meta": any device but the CPU default shows it)."""
    seen = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None: seen.append(tensor.device))
    norm = global_norm([], [object()], device=torch.device("meta"))
    assert seen == [torch.device("meta")] and norm.device == torch.device("meta")


class ComputeOps(TorchDispatchMode):
    """Counts the aten operators that compute (views and metadata left out): on CUDA each
    launches its kernels; a foreach operator is one, however many tensors it takes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _norm_and_clip_ops(layers: int) -> tuple[int, float, float]:
    """Operators that measure and clip one process's bf16-master gradients (ZeRO-1's pieces of
    its fp32 main-gradient buckets), with the norm and torch's own on the same gradients."""
    model = LlamaForCausalLM(tiny_config(layers=layers))
    model.init_weights(torch.Generator().manual_seed(0))
    zero = ZeroOptimizer(
        torch.optim.AdamW(model.parameters()), None, bucket_bytes=4096, grad_dtype=torch.float32
    )
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model(x, labels=x).backward()
    pieces = zero.grad_pieces({id(p) for p in model.parameters()})
    assert len(pieces) == len(list(model.parameters())) and len(zero.reducer.buckets) > 3
    want = torch.nn.utils.get_total_norm([p.clone() for p in pieces])
    with ComputeOps() as counted:
        norm = global_norm(pieces)
        clip_(pieces, norm, 1.0)  # the norms are 2.6 and 3.6: clipping scales
    return len(counted.ops), float(norm), float(want)


def test_norm_and_clipping_kernels_do_not_grow_with_the_parameters() -> None:
    """2 and 8 decoder blocks (14 and 50 gradient pieces in several buckets): the same handful of
    operators (the buckets are slices of one flat buffer: one norm, one scaling); the value is
    torch's `get_total_norm`'s."""
    small, large = _norm_and_clip_ops(2), _norm_and_clip_ops(8)
    assert small[0] == large[0] <= 12, (small, large)
    for _, norm, want in (small, large):
        assert norm == pytest.approx(want, rel=1e-6)


def test_norm_of_large_pieces_is_fp32_rounding_of_fp64() -> None:
    """Million-element pieces (a real model's embedding): within fp32 rounding of the fp64 norm
    (the CPU's fp32 `vector_norm` sums serially and is ~1e-4 off here)."""
    flat = torch.randn(6_000_000, generator=torch.Generator().manual_seed(0))
    pieces = [flat[:4_000_000], torch.randn(2_000_000, generator=torch.Generator().manual_seed(1))]
    want = torch.sqrt(sum(p.double().square().sum() for p in pieces))
    assert float(global_norm(pieces)) == pytest.approx(float(want), rel=2e-7)
