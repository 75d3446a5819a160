"""Gradients across tp x pp x cp x dp: made final, measured by one global norm, clipped. One home.

After the last micro-batch's backward every rank holds *partial* gradients; `GradientSync.finish`
completes them, in this order (each a sum over the group where the parts differ):

    partial part                         why it is partial                       summed over
    tp-replicated params (norm weights)  sequence parallelism: each tp rank      the tp group
                                         saw only its T/tp tokens
    a tied weight held by two stages     the embedding (first stage) and the     the {first, last}
                                         head (last stage) are one weight        stages' group
    every param                          each dp rank saw its own samples, each  the "replica" group
                                         cp rank its own tokens of them          (dp x cp; mean,
                                                                                 bucketed, overlapped)

The replica part is `GradReducer` (`data_parallel.py`; with ZeRO-1 the `ZeroOptimizer`'s reducer
reduce-scatters into this rank's 1/(dp*cp) shard); the first two run inside it, just before its
deferred buckets, or alone when there is no replica. (cp ranks hold the same weights, so to the
reduction they are replicas like dp's: `parallel/context.py`'s "replica" group is dp x cp.)

The global norm counts every gradient element exactly once (`ModelLayout.counts_in_norm`: a
tp-replicated parameter on tp rank 0 only, a tied weight on its lowest stage only); each rank
sums the squares of what it counts, and the sums are summed over tp and pp (and the replicas with
ZeRO-1, whose shards are disjoint; plain replica gradients are identical after the mean). Clipping multiplies
the final gradients (``param.grad``, or ZeRO-1's shards) by ``torch.nn.utils.clip_grad_norm_``'s
coefficient. (One process needs none of this: `Strategy.clip_gradients` is torch's own.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from nanolight.parallel.data_parallel import DEFAULT_BUCKET_BYTES, GradReducer
from nanolight.parallel.layout import ModelLayout
from nanolight.parallel.zero import ZeroOptimizer


def global_norm(
    grads: list[Tensor], groups: Iterable[Any] = (), device: torch.device | None = None
) -> Tensor:
    """L2 norm of `grads` (this rank's counted parts) joined with the same parts of the groups'
    other ranks: squares summed in fp32 per tensor (``vector_norm`` loses ~1e-4 on CPU for
    million-element tensors), then over each group in turn. A rank that counts nothing still
    joins, with a zero on `device` (the groups' device: NCCL refuses a CPU tensor)."""
    squared = (
        torch.stack([g.float().pow(2).sum() for g in grads]).sum()
        if grads
        else torch.zeros((), device=device)
    )
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            # the ranks of this group (tp, pp or dp) add up the squares of their parts
            dist.all_reduce(squared, group=group)
    return squared.sqrt()


def clip_(grads: list[Tensor], norm: Tensor, max_norm: float) -> None:
    """Scale `grads` so that their global `norm` is at most `max_norm` (torch's coefficient)."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


def _sum_over(grads: list[Tensor], group: Any) -> None:
    """Sum these gradients over `group`, in place, in one collective."""
    if not grads or group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    # the ranks of `group` (tp, or the tied weight's two stages) sum their partial gradients
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class GradientSync:
    """This rank's gradient duties for `module`, laid out as `layout` over `ctx`'s groups (see the
    module docstring). `zero_stage=1` wraps the optimizer in a `ZeroOptimizer`
    (`wrap_optimizers`); dp > 1 without ZeRO reduces ``param.grad`` in buckets. Collective
    (the tied weight's group is created here): every rank constructs it.
    """

    def __init__(
        self,
        module: nn.Module,
        layout: ModelLayout,
        ctx: Any,
        sequence_parallel: bool = False,
        zero_stage: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        self.ctx, self.zero_stage, self.bucket_bytes = ctx, zero_stage, bucket_bytes
        self.grad_dtype = grad_dtype  # main gradients (bf16-master): only with ZeRO-1's master weights
        if grad_dtype is not None and zero_stage != 1:
            raise ValueError("main gradients (grad_dtype) live in the ZeRO-1 optimizer: use zero_stage=1")
        partial = []  # (keys, group): gradients summed over the group before the dp reduction
        if sequence_parallel:  # norm weights saw T/tp tokens on each tp rank
            partial.append((layout.tp_replicated, ctx.tp_group))
        if layout.tied_across_stages:  # the first and last stage hold one weight's two copies
            partial.append((layout.tied_across_stages, ctx.stage_pair_group(0, ctx.pp_size - 1)))
        named = dict(module.named_parameters())
        self.params = [p for p in named.values() if p.requires_grad]
        # in parameter order: the ranks of a group must concatenate the same tensors in the same order
        self.partial = [([p for k, p in named.items() if k in keys], g) for keys, g in partial]
        self.partial = [
            (ps, g) for ps, g in self.partial if ps and g is not None and dist.get_world_size(g) > 1
        ]
        self.counted = [p for k, p in named.items() if layout.counts_in_norm(k)]
        self.reducer: GradReducer | None = None
        self.zero: ZeroOptimizer | None = None
        replicas = ctx.group("replica")  # dp x cp: the ranks holding the same weights
        self._norm_groups = [ctx.tp_group, ctx.pp_group] + ([replicas] if zero_stage else [])
        self._norm: Tensor | None = None  # this step's norm once measured: NaNGuard and clipping share it

    def wrap_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[Any]:
        deferred = {id(p) for ps, _ in self.partial for p in ps}
        if self.zero_stage == 1:
            if len(optimizers) != 1:
                raise ValueError(
                    f"zero_stage=1 shards one optimizer; configure_optimizers returned {len(optimizers)}. "
                    "Use param groups (one optimizer) or zero_stage=0"
                )
            self.zero = ZeroOptimizer(
                optimizers[0],
                self.ctx.group("replica"),
                self.bucket_bytes,
                deferred=deferred,
                grad_dtype=self.grad_dtype,
            )
            self.reducer = self.zero.reducer
            return [self.zero]
        if self.ctx.size("replica") > 1:
            replicas = self.ctx.group("replica")
            self.reducer = GradReducer([self.params], replicas, self.bucket_bytes, deferred=deferred)
        return optimizers

    def require_sync(self, last_micro_batch: bool) -> None:
        """Before each backward: reduce over the replicas only in the step's last one (DDP's ``no_sync``)."""
        if self.reducer is not None:
            self.reducer.require_sync(last_micro_batch)

    def finish(self) -> None:
        """After the step's last backward: complete the partial gradients, then the dp reduction
        (the reducer calls `_sum_partials` once every ``.grad`` is bound to its bucket)."""
        self._norm = None  # new gradients
        if self.reducer is None:
            self._sum_partials()
        else:
            self.reducer.finish(self._sum_partials)

    def _sum_partials(self) -> None:
        for params, group in self.partial:
            if self.reducer is not None:  # every gradient is bound to its bucket (main gradients too)
                _sum_over([self.reducer.grad_view(p) for p in params], group)
                continue
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)  # a copy without a gradient still takes part
            _sum_over([p.grad for p in params], group)

    def zero_grad(self, optimizer: Any) -> None:
        self._norm = None
        if self.zero is not None:
            self.zero.zero_grad()
        elif self.reducer is not None:
            self.reducer.zero_grad()  # keeps .grad as bucket views (set_to_none would drop them)
        else:
            optimizer.zero_grad(set_to_none=True)

    def _final_grads(self) -> list[Tensor]:
        if self.zero is not None:
            return self.zero.reduced_grads()
        return [p.grad for p in self.params if p.grad is not None]

    def norm(self) -> Tensor:
        """The global L2 norm of the step's final gradients, the same on every rank. Measured once
        per set of gradients (its all-reduces are not free at scale): `NaNGuard`'s check and the
        clipping after it read the same tensor; new gradients, zeroing or clipping measure anew."""
        if self._norm is None:
            if self.zero is not None:
                counted = self.zero.grad_pieces({id(p) for p in self.counted})
            else:
                counted = [p.grad for p in self.counted if p.grad is not None]
            self._norm = global_norm(counted, self._norm_groups, self.ctx.device).to(self.ctx.device)
        return self._norm

    def clip_(self, max_norm: float | None) -> Tensor:
        """Clip by the global norm (None: only measure it); returns the pre-clip norm."""
        norm = self.norm()
        if max_norm is not None:
            clip_(self._final_grads(), norm, max_norm)
            self._norm = None  # the gradients changed
        return norm

    def clip_value_(self, value: float) -> None:
        """Clamp the step's final gradients elementwise (the dp-reduced ones, or the ZeRO-1 shards
        the optimizer steps with): no communication, the same result at every layout."""
        self._norm = None
        for grad in self._final_grads():
            grad.clamp_(-value, value)
