"""The global gradient norm over tp x pp x dp, every parameter counted exactly once, and clipping.

Why "counted once" needs care: a parameter replicated over tp (a norm weight) has the same
gradient on every tp rank, a tied embedding lives on the first and the last pipeline stage, and
after the dp reduction every dp replica holds the same gradients. Summing squared norms over
all ranks would count those several times. The rule here: each rank computes the squared norm
of the gradients it *owns* for the norm, and the squares are summed over the groups in which
the owned parts differ:

    tp-sharded parameter          owned by every tp rank (each holds a different slice)  -> sum over tp
    tp-replicated parameter       owned by tp rank 0 only                               -> sum over tp
    pp: each stage's parameters   owned by that stage; a parameter that several stages   -> sum over pp
                                  hold (the tied embedding) is owned by one of them:
                                  the others pass its id in `excluded`
    dp without ZeRO               identical on every dp rank                            -> no dp sum
    dp with ZeRO-1                each rank holds a different 1/dp shard                -> sum over dp

Under pipeline parallelism the strategy passes `excluded` (ids of this stage's copies of
parameters that another stage owns for the norm) and `pp_group`; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from nanolight.parallel.tensor_parallel.apply import shard_dims


def owned_for_norm(model: nn.Module, tp_rank: int, excluded: Collection[int] = ()) -> frozenset[int]:
    """ids of the parameters whose gradients this rank contributes to the global norm;
    `excluded`: ids of parameters another pipeline stage counts (this stage's tied copy)."""
    dims = shard_dims(model)
    return frozenset(
        id(p)
        for name, p in model.named_parameters()
        if id(p) not in excluded and (dims[name] is not None or tp_rank == 0)
    )


def sum_over_groups(value: Tensor, groups: Iterable[Any]) -> Tensor:
    """Sum a (squared-norm) scalar over each process group in turn (None or size 1: skipped)."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            # the ranks of this group (tp, pp or dp) add up their squared gradient norms
            dist.all_reduce(value, group=group)
    return value


def grad_norm(
    model: nn.Module,
    owned: frozenset[int],
    tp_group: Any = None,
    pp_group: Any = None,
    dp_group: Any = None,
    zero: Any = None,
) -> Tensor:
    """Global L2 norm of the gradients. With a `ZeroOptimizer` the reduced gradients are its
    shards (summed over `dp_group`); otherwise ``param.grad`` (already dp-identical)."""
    if zero is not None:
        squared = zero.squared_grad_norm(owned)
        return sum_over_groups(squared, (tp_group, pp_group, dp_group)).sqrt()
    device = next(model.parameters()).device
    parts = [
        p.grad.detach().float().pow(2).sum()
        for p in model.parameters()
        if id(p) in owned and p.grad is not None
    ]
    squared = torch.stack(parts).sum() if parts else torch.zeros((), device=device)
    return sum_over_groups(squared, (tp_group, pp_group)).sqrt()


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """The factor ``torch.nn.utils.clip_grad_norm_`` applies (1 when under the limit)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_grads_(model: nn.Module, norm: Tensor, max_norm: float, zero: Any = None) -> None:
    """Scale the reduced gradients so that their global norm is at most `max_norm`."""
    coef = clip_coefficient(norm, max_norm)
    if zero is not None:
        zero.scale_grads_(coef)
        return
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
