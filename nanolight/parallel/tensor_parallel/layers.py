"""Tensor-parallel layers: each holds a contiguous slice of its dense twin's weight.

    ColumnParallelLinear   weight rows (output features) split:   W = [W_0; W_1; ...]   y_r = x W_r^T
    RowParallelLinear      weight columns (input features) split: W = [W_0, W_1, ...]   y = sum_r x_r W_r^T
    VocabParallelEmbedding embedding rows (vocabulary) split:     rank r owns ids [r*V/tp, (r+1)*V/tp)

The parameter is always called `weight` and each class records which dim is sharded
(`tp_shard_dim`), so state-dict keys are those of the plain model and a full tensor is one
`unshard(shards, tp_shard_dim, tp_chunks)` away: checkpoints load at any layout.

A column layer whose output is several tensors side by side (the MLP's [gate | up]) splits each
of its `tp_chunks` equal row blocks over tp, so shard k = [gate_k | up_k] and every rank holds
matching halves (nanotron's ``contiguous_chunks``); `shard_of` / `unshard` are that rule.

With `sequence_parallel=True` the activations *between* TP regions are split by token (each rank
1/tp of the B*T tokens, shaped (B, T/tp, H): `comm.token_chunk`): a column layer all-gathers the
tokens first, a row layer (and the embedding) reduce-scatters its output instead of all-reducing
it. Same bytes on the wire as all-reduce, but norms, residuals and dropout run on 1/tp of the
tokens per rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanolight.parallel.tensor_parallel import comm


def _shard_size(total: int, size: int, what: str) -> int:
    if total % size != 0:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {size}")
    return total // size


def shard_of(full: Tensor, dim: int, rank: int, size: int, chunks: int = 1) -> Tensor:
    """Rank `rank`'s shard of `full`: of each of its `chunks` equal blocks along `dim`, the
    rank's 1/size slice, concatenated (chunks=1: one contiguous slice, a view)."""
    if chunks == 1:
        return full.chunk(size, dim=dim)[rank]
    return torch.cat([block.chunk(size, dim=dim)[rank] for block in full.chunk(chunks, dim=dim)], dim=dim)


def unshard(shards: list[Tensor], dim: int, chunks: int = 1) -> Tensor:
    """The full tensor from every rank's `shard_of`, in rank order (its inverse)."""
    pieces = [shard.chunk(chunks, dim=dim) for shard in shards]
    return torch.cat([p[j] for j in range(chunks) for p in pieces], dim=dim)


class _ParallelLinear(nn.Module):
    """A bias-free linear layer holding the `tp_shard_dim` slice of its dense twin's weight."""

    tp_shard_dim = 0
    tp_chunks = 1  # blocks along tp_shard_dim split over tp one by one (`shard_of`)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Any,
        *,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.tp_rank, self.tp_size = comm.tp_world(group)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel
        shape = [out_features, in_features]
        what = ("out_features", "in_features")[self.tp_shard_dim]
        shape[self.tp_shard_dim] = _shard_size(shape[self.tp_shard_dim], self.tp_size, what)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


class ColumnParallelLinear(_ParallelLinear):
    """Linear layer whose output features are split over the tp group (no bias: Llama has none).

    `gather_output=False` leaves the output sharded on the last dim, which is what the next
    row-parallel layer (or the vocab-parallel loss) wants: no communication at the exit.
    `input_is_gathered=True` (sequence parallelism only) means the caller already all-gathered
    the sequence with `comm.gather_from_sp`, e.g. once for a whole attention block.
    `chunks` > 1: the output features are that many equal blocks, each split over tp (`shard_of`).
    """

    tp_shard_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Any,
        *,
        gather_output: bool = False,
        input_is_gathered: bool = False,
        chunks: int = 1,
        **common: Any,  # sequence_parallel, device, dtype
    ) -> None:
        if out_features % chunks != 0:
            raise ValueError(f"out_features={out_features} is not {chunks} equal blocks")
        _shard_size(out_features // chunks, comm.tp_world(group)[1], f"out_features / {chunks}")
        if gather_output and chunks > 1:
            raise ValueError(
                "gather_output=True needs chunks=1: a gathered output would interleave the blocks"
            )
        super().__init__(in_features, out_features, group, **common)
        self.gather_output, self.input_is_gathered = gather_output, input_is_gathered
        self.tp_chunks = chunks

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(self.entry(x), self.weight)  # (..., out/tp)
        return comm.gather_from_tp(y, self.group) if self.gather_output else y

    def entry(self, x: Tensor) -> Tensor:
        """The input as the layer multiplies it: the whole sequence on every tp rank, its gradient
        summed over them in backward (each rank's is partial: its slice of the output's)."""
        if self.input_is_gathered:
            return x  # the caller already ran gather_from_sp, whose backward reduce-scatters for us
        if self.sequence_parallel:
            return comm.gather_from_sp(x, self.group)  # (B, T/tp, H) -> (B, T, H)
        return comm.copy_to_tp(x, self.group)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.weight.shape[0]}), tp={self.tp_size}, chunks={self.tp_chunks}, "
            f"gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(_ParallelLinear):
    """Linear layer whose input features are split over the tp group.

    Its input is the sharded output of a column-parallel layer (`input_is_parallel=True`), so
    each rank computes a partial sum of the output; the partials are all-reduced (or, with
    sequence parallelism, reduce-scattered by token).
    """

    tp_shard_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Any,
        *,
        input_is_parallel: bool = True,
        **common: Any,
    ) -> None:
        super().__init__(in_features, out_features, group, **common)
        self.input_is_parallel = input_is_parallel

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = comm.scatter_to_tp(x, self.group)
        partial = F.linear(x, self.weight)  # (..., out): this rank's share of the sum
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sp(partial, self.group)  # (B, T/tp, out)
        return comm.reduce_from_tp(partial, self.group)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
            f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over the tp group.

    Each rank looks up the ids it owns and writes zeros for the others; summing over the group
    (all-reduce, or reduce-scatter by token with sequence parallelism) then gives
    every rank the full embedding. Rank r owns ids [r * V/tp, (r + 1) * V/tp).
    """

    tp_shard_dim = 0
    tp_chunks = 1

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: Any,
        *,
        sequence_parallel: bool = False,
        **factory: Any,
    ) -> None:
        """`factory`: ``device`` / ``dtype`` of the weight."""
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.tp_rank, self.tp_size = comm.tp_world(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = _shard_size(num_embeddings, self.tp_size, "num_embeddings (vocab_size)")
        self.vocab_start, self.vocab_end = self.tp_rank * local, (self.tp_rank + 1) * local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, **factory))

    def forward(self, ids: Tensor) -> Tensor:
        foreign = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(foreign, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sp(partial, self.group)  # (B, T/tp, H)
        return comm.reduce_from_tp(partial, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, local ids [{self.vocab_start}, {self.vocab_end}), "
            f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}"
        )


TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
