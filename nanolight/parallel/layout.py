"""`ModelLayout`: where every tensor of a parallelised module lives, and which rank answers for it.

Made once, when the strategy has applied tensor parallelism and the pipeline split; every
cross-cutting concern reads it instead of re-deriving the answer (checkpoints: who writes which
block; gradients: which are partial sums, which are tied across stages, which count in the global
norm). It is pure data, the same arithmetic on every rank, no communication:

    question                         answer
    blocks(key)                      this rank's [offset, offset + shape) of the global tensor: one
                                     block, or one per chunk of a tensor tp splits chunk by chunk
                                     (the MLP's [gate | up]: shard k = [gate_k | up_k], two blocks)
    stores(key)                      this rank writes the block to a checkpoint: the lowest stage
                                     holding it, tp rank 0 if it is replicated over tp, replica
                                     rank 0 (replicas: dp x cp; a ZeRO-1 partition: every
                                     replica writes its own piece)
    counts_in_norm(key)              this rank's gradient enters the global norm: the same rule
                                     without the replicas (ZeRO shards are disjoint; plain
                                     replicas are identical)
    tp_replicated                    keys every tp rank holds whole (norm weights): under sequence
                                     parallelism each rank's gradient is a partial sum over its tokens
    tied_across_stages               keys two stages hold (the tied embedding): their gradients are
                                     two halves of one, summed over those stages

One process is the trivial layout (`ModelLayout.whole`): every block is the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch import nn

from nanolight.parallel.tensor_parallel.apply import shard_chunks, shard_dims


def live_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Key -> the module's own parameter or buffer object, tied ones under each of their names.
    Read from ``named_parameters`` / ``named_buffers`` rather than ``state_dict(keep_vars=True)``:
    a module may override ``state_dict`` without that argument, as Lightning's docs show."""
    params = module.named_parameters(remove_duplicate=False)
    return dict(chain(params, module.named_buffers(remove_duplicate=False)))


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """State-dict key -> the first key naming the same tensor (e.g. lm_head -> embed_tokens)."""
    first: dict[int, str] = {}
    aliases = {}
    keys = set(module.state_dict())
    for key, tensor in live_tensors(module).items():
        if key not in keys:  # a non-persistent buffer
            continue
        if id(tensor) in first:
            aliases[key] = first[id(tensor)]
        else:
            first[id(tensor)] = key
    return aliases


@dataclass(frozen=True)
class ModelLayout:
    """See the module docstring. Keys are the module's state-dict keys (stable at every layout)."""

    full_shapes: dict[str, tuple[int, ...]]  # the unsharded, unsplit module
    aliases: dict[str, str]  # tied key -> the key it shares a tensor with (stored once)
    tp_dims: dict[str, int | None] = field(default_factory=dict)  # this rank's keys -> dim split over tp
    holders: dict[str, tuple[int, ...]] = field(default_factory=dict)  # key -> pipeline stages holding it
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    replica_rank: int = 0  # among the ranks holding the same weights: dp x cp (`context.py` "replica")
    tp_chunks: dict[str, int] = field(default_factory=dict)  # keys split over tp block by block (`shard_of`)

    @classmethod
    def whole(cls, module: nn.Module) -> ModelLayout:
        """One process: every tensor whole, on the one stage."""
        shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        return cls(shapes, tied_aliases(module), dict.fromkeys(shapes), dict.fromkeys(shapes, (0,)))

    @classmethod
    def sharded(
        cls,
        module: nn.Module,
        full_shapes: dict[str, tuple[int, ...]],
        aliases: dict[str, str],
        ctx: Any,
        split: Any = None,
        prefix: str = "",
    ) -> ModelLayout:
        """The layout of `module` after tensor parallelism (and the pipeline `split` of the model
        at key `prefix`), for this rank of `ctx`; `full_shapes` / `aliases` of the full module."""
        dims = shard_dims(module, remove_duplicate=False)
        holders = {k: split.holders(k.removeprefix(prefix)) if split else (0,) for k in full_shapes}
        tp_dims = {k: dims.get(k) for k in module.state_dict()}
        replica = ctx.rank_in("replica")
        chunks = shard_chunks(module)
        return cls(
            full_shapes, aliases, tp_dims, holders, ctx.tp_rank, ctx.tp_size, ctx.pp_rank, replica, chunks
        )

    @property
    def coords(self) -> dict[str, int]:
        """Recorded with each checkpoint shard; "dp" is the replica index (a ZeRO-1 piece's owner)."""
        return {"pp": self.pp_rank, "tp": self.tp_rank, "dp": self.replica_rank}

    def blocks(
        self, key: str, local_shape: torch.Size | tuple[int, ...]
    ) -> list[tuple[list[int], list[int]]]:
        """(offset, shape) in global tensor `key` of each of this rank's blocks, in the order they
        lie in its local tensor along the tp dim: one (the local tensor is one slice), or one per
        chunk (chunk j of the local tensor is this rank's slice of the global tensor's chunk j)."""
        dim, chunks = self.tp_dims.get(key), self.tp_chunks.get(key, 1)
        if dim is None:
            return [([0] * len(local_shape), list(local_shape))]
        shape = list(local_shape)
        shape[dim] //= chunks
        out = []
        for j in range(chunks):
            offset = [0] * len(local_shape)
            offset[dim] = (j * self.tp_size + self.tp_rank) * shape[dim]
            out.append((offset, list(shape)))
        return out

    def _answers(self, key: str) -> bool:
        """This rank speaks for `key` among its tp group and the stages holding it."""
        if key in self.aliases or min(self.holders.get(key, (0,))) != self.pp_rank:
            return False
        return self.tp_dims.get(key) is not None or self.tp_rank == 0

    def stores(self, key: str, zero_piece: bool = False) -> bool:
        return self._answers(key) and (zero_piece or self.replica_rank == 0)

    def counts_in_norm(self, key: str) -> bool:
        return self._answers(key)

    @property
    def tp_replicated(self) -> set[str]:
        return {k for k, d in self.tp_dims.items() if d is None and k not in self.aliases}

    @property
    def tied_across_stages(self) -> set[str]:
        return {k for k, stages in self.holders.items() if len(stages) > 1 and k not in self.aliases}
