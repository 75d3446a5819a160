"""Autograd-aware tensor-parallel collectives: each forward collective has its adjoint as backward.

The four tensor-parallel regions (Megatron-LM's f / g operators and their gather/scatter cousins):

    copy_to_tp        forward identity        backward all-reduce      (before a column-parallel layer)
    reduce_from_tp    forward all-reduce      backward identity        (after a row-parallel layer)
    gather_from_tp    forward all-gather      backward split           (last dim: vocab / features)
    scatter_to_tp     forward split           backward all-gather      (last dim)

and the sequence-parallel pair, which replaces copy/reduce around the same layers when the
activations between them are sharded by token:

    gather_from_sp        forward all-gather          backward reduce-scatter
    reduce_scatter_to_sp  forward reduce-scatter      backward all-gather
    scatter_to_sp         forward split               backward all-gather

A sequence-parallel shard is `token_chunk`: rank r holds the r-th contiguous 1/tp of the
micro-batch's B*T tokens in memory order, presented as (B, T/tp, H). Every operator between the
regions (norms, residual adds, casts, a pipeline boundary) works token by token, so which tokens a
rank holds is the collectives' business alone; holding memory-contiguous rows lets them gather and
scatter in place. A shard of each row's T/tp positions (Megatron's, whose activations are (T, B, H))
would copy the whole (B, T, H) tensor around every collective once B > 1.

All exchanges are among the ranks of one tensor-parallel group (same dp and pp coordinates).
"""

from __future__ import annotations

from collections.abc import Callable
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
    # every rank of `group` (the tp ranks) adds its partial result: each ends with the full sum
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _split(x: Tensor, dim: int, group: Any) -> Tensor:
    rank, size = tp_world(group)
    if x.shape[dim] % size != 0:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} into {size} equal tp shards")
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


def _chunk_shape(x: Tensor, size: int) -> tuple[int, ...]:
    """(B, T/size, ...): the shape of one of `size` sequence-parallel shards of a (B, T, ...) `x`."""
    if x.shape[1] % size != 0:
        raise ValueError(
            f"cannot split a sequence of {x.shape[1]} tokens into {size} equal tp shards{_SP_HINT}"
        )
    return (x.shape[0], x.shape[1] // size, *x.shape[2:])


def token_chunk(x: Tensor, rank: int, size: int) -> Tensor:
    """Rank `rank`'s sequence-parallel shard of a contiguous (B, T, ...) tensor: the rows
    [rank * n, (rank + 1) * n) of its B*T tokens (n = B*T / size), as a (B, T/size, ...) view."""
    shape = _chunk_shape(x, size)
    rows = x.view(-1, *x.shape[2:])  # (B*T, ...)
    n = rows.shape[0] // size
    return rows[rank * n : (rank + 1) * n].view(shape)


class _Region(torch.autograd.Function):
    """A tensor-parallel region boundary: `forward(x, group)` going in, its adjoint `backward`
    for the gradient coming out (each one of the collectives above, or none)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, forward: Callable, backward: Callable) -> Tensor:
        ctx.group, ctx.adjoint = group, backward
        return forward(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return ctx.adjoint(grad, ctx.group), None, None, None


def _identity(x: Tensor, group: Any) -> Tensor:
    return x


def _sum(x: Tensor, group: Any) -> Tensor:
    return _all_reduce(x.clone(), group)  # tp ranks: sum their partial tensors


def _gather_last(x: Tensor, group: Any) -> Tensor:
    return all_gather_tensor(x, -1, group)  # tp ranks: exchange last-dim shards


def _split_last(x: Tensor, group: Any) -> Tensor:
    return _split(x, -1, group)


def _gather_seq(x: Tensor, group: Any) -> Tensor:
    """Every rank's `token_chunk` -> the whole (B, T, ...), gathered straight into place."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    out = x.new_empty((x.shape[0], x.shape[1] * size, *x.shape[2:]))
    # tp ranks: exchange their token chunks (rank r's lands in rows r*n:(r+1)*n of the flat out)
    _all_gather_single(out.view(-1, *x.shape[2:]), x.reshape(-1, *x.shape[2:]).contiguous(), group=group)
    return out


def _reduce_scatter_seq(x: Tensor, group: Any) -> Tensor:
    """A partial (B, T, ...) -> this rank's `token_chunk` of the sum over the tp ranks."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    x = x.contiguous()  # a matmul's output: already
    out = x.new_empty(_chunk_shape(x, size))
    # tp ranks: sum their partial tensors, each keeping its token chunk's rows
    _reduce_scatter_single(
        out.view(-1, *x.shape[2:]), x.view(-1, *x.shape[2:]), op=dist.ReduceOp.SUM, group=group
    )
    return out


def _split_seq(x: Tensor, group: Any) -> Tensor:
    rank, size = tp_world(group)
    return token_chunk(x.contiguous(), rank, size)


def copy_to_tp(x: Tensor, group: Any) -> Tensor:
    """Before a column-parallel layer: every rank holds the input; each rank's column shard gives
    a partial input gradient, summed over tp."""
    return _Region.apply(x, group, _identity, _sum)


def reduce_from_tp(x: Tensor, group: Any) -> Tensor:
    """After a row-parallel layer: sum the partial outputs; the gradient passes through."""
    return _Region.apply(x, group, _sum, _identity)


def gather_from_tp(x: Tensor, group: Any) -> Tensor:
    """Last-dim shards (vocab slices of the logits) -> the full tensor; each rank keeps its
    slice's gradient."""
    return _Region.apply(x, group, _gather_last, _split_last)


def scatter_to_tp(x: Tensor, group: Any) -> Tensor:
    """A replicated tensor -> this rank's last-dim slice; slice gradients are all-gathered."""
    return _Region.apply(x, group, _split_last, _gather_last)


def gather_from_sp(x: Tensor, group: Any) -> Tensor:
    """(B, T/tp, H) token chunks -> (B, T, H) before a column-parallel layer; its full input
    gradient is a partial sum (this rank's column shard), reduce-scattered back to the chunks."""
    return _Region.apply(x, group, _gather_seq, _reduce_scatter_seq)


def reduce_scatter_to_sp(x: Tensor, group: Any) -> Tensor:
    """After a row-parallel layer: sum the partial (B, T, H), each rank keeping its (B, T/tp, H)
    chunk; the chunk gradients are all-gathered."""
    return _Region.apply(x, group, _reduce_scatter_seq, _gather_seq)


def scatter_to_sp(x: Tensor, group: Any) -> Tensor:
    """A replicated (B, T, H) -> this rank's token chunk; chunk gradients are all-gathered."""
    return _Region.apply(x, group, _split_seq, _gather_seq)
