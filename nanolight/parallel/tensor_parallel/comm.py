"""Autograd-aware tensor-parallel collectives: each forward collective has its adjoint as backward.

The four tensor-parallel regions (Megatron-LM's f / g operators and their gather/scatter cousins):

    copy_to_tp        forward identity        backward all-reduce      (before a column-parallel layer)
    reduce_from_tp    forward all-reduce      backward identity        (after a row-parallel layer)
    gather_from_tp    forward all-gather      backward split           (last dim: vocab / features)
    scatter_to_tp     forward split           backward all-gather      (last dim)

and the sequence-parallel pair, which replaces copy/reduce around the same layers when the
activations between them are sharded along the sequence (dim 1 of (B, T, H)):

    gather_from_sp        forward all-gather(T)       backward reduce-scatter(T)
    reduce_scatter_to_sp  forward reduce-scatter(T)   backward all-gather(T)
    scatter_to_sp         forward split(T)            backward all-gather(T)

All exchanges are among the ranks of one tensor-parallel group (same dp and pp coordinates).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# torch >= 2.11 renamed the "_into_tensor" collectives to "_single"; support both.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_SP_HINT = " (with sequence parallelism, the sequence length must be a multiple of tp)"


def tp_world(group: Any) -> tuple[int, int]:
    """(rank, size) of this process inside `group`."""
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(x: Tensor, group: Any) -> Tensor:
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _split(x: Tensor, dim: int, group: Any) -> Tensor:
    rank, size = tp_world(group)
    if x.shape[dim] % size != 0:
        raise ValueError(
            f"cannot split dim {dim} of size {x.shape[dim]} into {size} equal tp shards{_SP_HINT}"
        )
    return x.chunk(size, dim=dim)[rank].contiguous()


def all_gather_tensor(x: Tensor, dim: int, group: Any) -> Tensor:
    """Concatenate every tp rank's `x` along `dim` (plain collective, no autograd)."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    # The single-tensor collective concatenates along dim 0, so gather with `dim` moved first.
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: Tensor, dim: int, group: Any) -> Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size != 0:
        raise ValueError(
            f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {size} tp ranks{_SP_HINT}"
        )
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    _reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim)


class _CopyToTP(torch.autograd.Function):
    """Forward: every tp rank already holds the same input, keep it.
    Backward: each rank's column shard produced only a partial input gradient; tp ranks
    all-reduce (sum) those partials so every rank gets the full gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad.clone(), ctx.group), None  # tp ranks: sum partial input grads


class _ReduceFromTP(torch.autograd.Function):
    """Forward: tp ranks all-reduce (sum) their partial outputs (row-parallel matmul pieces).
    Backward: the summed output's gradient is the same on every rank; pass it through."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        return _all_reduce(x.clone(), group)  # tp ranks: sum partial outputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: tp ranks all-gather their last-dim shards (e.g. vocab slices of the logits).
    Backward: each rank keeps the gradient of its own slice (no communication)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return all_gather_tensor(x, -1, group)  # tp ranks: exchange last-dim shards

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _split(grad, -1, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    """Forward: each rank keeps its last-dim slice of a replicated tensor (no communication).
    Backward: tp ranks all-gather the slice gradients back into the full gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_gather_tensor(grad, -1, ctx.group), None  # tp ranks: exchange slice grads


class _GatherFromSP(torch.autograd.Function):
    """Forward: tp ranks all-gather their sequence chunks (B, T/tp, H) -> (B, T, H) before a
    column-parallel layer. Backward: each rank's input gradient over the full sequence is a
    partial sum (its column shard only); tp ranks reduce-scatter it, each keeping the summed
    gradient of its own sequence chunk."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return all_gather_tensor(x, 1, group)  # tp ranks: exchange sequence chunks

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _reduce_scatter(grad, 1, ctx.group), None  # tp ranks: sum partials, keep own chunk


class _ReduceScatterToSP(torch.autograd.Function):
    """Forward: after a row-parallel layer every rank holds a partial (B, T, H); tp ranks
    reduce-scatter it so each keeps the sum for its sequence chunk (B, T/tp, H).
    Backward: tp ranks all-gather the chunk gradients (the full-sequence gradient is the same
    for every partial summand)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _reduce_scatter(x, 1, group)  # tp ranks: sum partial outputs, keep own chunk

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_gather_tensor(grad, 1, ctx.group), None  # tp ranks: exchange chunk grads


class _ScatterToSP(torch.autograd.Function):
    """Forward: each rank keeps its sequence chunk of a replicated (B, T, H) (no communication).
    Backward: tp ranks all-gather the chunk gradients into the full-sequence gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _split(x, 1, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_gather_tensor(grad, 1, ctx.group), None  # tp ranks: exchange chunk grads


def copy_to_tp(x: Tensor, group: Any) -> Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: Any) -> Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: Tensor, group: Any) -> Tensor:
    return _GatherFromTP.apply(x, group)


def scatter_to_tp(x: Tensor, group: Any) -> Tensor:
    return _ScatterToTP.apply(x, group)


def gather_from_sp(x: Tensor, group: Any) -> Tensor:
    return _GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x: Tensor, group: Any) -> Tensor:
    return _ReduceScatterToSP.apply(x, group)


def scatter_to_sp(x: Tensor, group: Any) -> Tensor:
    return _ScatterToSP.apply(x, group)
