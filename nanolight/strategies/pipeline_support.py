"""What `Parallel3DStrategy` needs for pipeline parallelism, kept out of the strategy file.

`PipelineSetup.build` does the pipeline part of `setup_module`, in the documented order:
remember the full model's parameter names/shapes (for init and checkpoints), let tensor
parallelism shard the plain model, cut it into stages (`split_causal_lm`), and after the
strategy materialises it, initialise the stage topology-independently and build the engine.

The rest are the pipeline-aware versions of three strategy duties:
* the global gradient norm (summed over tp *and* pp; a tied embedding counted once),
* checkpoints in the single-device format: each stage's full tensors (already tp-gathered)
  go to pipeline rank 0, optimizer state is re-indexed to the single-device parameter order,
* metrics: values logged on every rank are taken from the last stage, which owns the loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanolight.parallel.pipeline import (
    PipelineEngine,
    PipelineStage,
    StageP2P,
    balanced_layer_split,
    init_stage_,
    llama_stage_costs,
    param_specs,
    split_causal_lm,
    tie_stage_weights,
)
from nanolight.parallel.tensor_parallel.apply import shard_dims


class PipelineSetup:
    """One rank's pipeline: its stage, engine and the full model's names (for checkpoints)."""

    def __init__(self, ctx: Any, schedule: str, layers_per_stage: list[int] | None = None) -> None:
        self.ctx, self.schedule, self.layers_per_stage = ctx, schedule, layers_per_stage
        self.engine: PipelineEngine | None = None
        self.lm: nn.Module | None = None

    # ---- setup ---------------------------------------------------------------------------
    def record_full_model(self, module: nn.Module, lm: nn.Module) -> None:
        """Before sharding: the unsplit model's parameter specs and state-dict shapes (meta, free)."""
        self.specs = param_specs(lm)
        self.full_shapes = {k: torch.empty(v.shape, device="meta") for k, v in module.state_dict().items()}
        self.full_order = [name for name, _ in module.named_parameters()]

    def split(self, lm: nn.Module) -> range:
        """Drop the other stages' modules from the (tp-sharded, meta) model; returns our layers."""
        cfg, ctx = lm.config, self.ctx
        costs = llama_stage_costs(cfg)
        ranges = balanced_layer_split(
            cfg.num_hidden_layers, ctx.pp_size, *costs, layers_per_stage=self.layers_per_stage
        )
        self.layers = ranges[ctx.pp_rank]
        self.lm = split_causal_lm(lm, ctx.pp_rank, ctx.pp_size, self.layers)
        self.tied = bool(cfg.tie_word_embeddings)
        return self.layers

    def retie(self) -> None:
        tie_stage_weights(self.lm)

    def init_weights(self, seed: int, tp_group: Any) -> None:
        init_stage_(self.lm, self.specs, torch.Generator().manual_seed(seed), tp_group)

    def build_engine(self) -> PipelineEngine:
        ctx = self.ctx
        p2p = StageP2P(ctx.prev_pp_rank, ctx.next_pp_rank, ctx.device)
        stage = PipelineStage(self.lm, ctx.pp_rank, ctx.pp_size, p2p)
        self.engine = PipelineEngine(
            stage,
            self.schedule,
            ctx.pp_group,
            ctx.pp_ranks[-1],
            tied_weight=self._tied_weight,
            tie_group=self._tie_group() if self.tied else None,
        )
        return self.engine

    def _tied_weight(self) -> torch.Tensor | None:
        embed = self.lm.model.embed_tokens
        return embed.weight if embed is not None else None

    def _tie_group(self) -> Any:
        """The {first stage, last stage} group of this rank's (dp, tp) coordinate, or None.

        Group creation is collective: every rank creates every pair's group, in the same order.
        """
        ctx, mine = self.ctx, None
        dp, pp, tp = ctx.mesh.shape
        for d in range(dp):
            for t in range(tp):
                ranks = [int(ctx.mesh[d, 0, t]), int(ctx.mesh[d, pp - 1, t])]
                group = dist.new_group(ranks=ranks)
                if ctx.global_rank in ranks:
                    mine = group
        return mine

    # ---- gradient norm -------------------------------------------------------------------
    def grad_norm_squared(self, module: nn.Module, tp_group: Any) -> torch.Tensor:
        """Squared global grad norm over tp and pp; replicated params once per tp group, and the
        tied embedding once per pipeline (the last stage's copy is skipped)."""
        dims = shard_dims(module)
        skip = set()
        if self.tied and self.ctx.is_last_stage and self.lm.model.embed_tokens is not None:
            skip.add(id(self.lm.model.embed_tokens.weight))
        device = self.ctx.device
        sharded = torch.zeros((), device=device)
        replicated = torch.zeros((), device=device)
        for name, p in module.named_parameters():
            if p.grad is None or id(p) in skip:
                continue
            sq = p.grad.detach().float().pow(2).sum()
            if dims[name] is None:
                replicated += sq
            else:
                sharded += sq
        if dist.get_world_size(tp_group) > 1:
            dist.all_reduce(sharded, group=tp_group)  # tp ranks sum their shards' squared norms
        total = sharded + replicated
        dist.all_reduce(total, group=self.ctx.pp_group)  # stages sum their layers' squared norms
        return total

    # ---- metrics -------------------------------------------------------------------------
    def from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        assert self.engine is not None
        return self.engine.broadcast_from_last_stage(value.to(self.ctx.device))

    # ---- checkpoints ---------------------------------------------------------------------
    def gather_model_state(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's full tensors merged on pipeline rank 0, in single-device key order.

        Call on the tp rank 0 of every stage (they hold the tp-gathered tensors); {} elsewhere.
        """
        ctx = self.ctx
        parts: list[Any] | None = [None] * ctx.pp_size if ctx.pp_rank == 0 else None
        # each stage sends its {name: full tensor} to pipeline rank 0
        dist.gather_object(local, parts, dst=ctx.pp_ranks[0], group=ctx.pp_group)
        if ctx.pp_rank != 0:
            return {}
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for name, tensor in part.items():
                merged.setdefault(name, tensor)  # a tied embedding: first stage's copy (identical)
        return {k: merged[k] for k in self.full_shapes if k in merged}

    def local_state_for_load(
        self, state: dict[str, torch.Tensor], local_keys: Any
    ) -> dict[str, torch.Tensor]:
        """Check a full checkpoint against the *whole* model, then keep this stage's entries."""
        from nanolight.strategies.base import check_state_dict_matches

        check_state_dict_matches(self.full_shapes, state)
        return {k: v for k, v in state.items() if k in local_keys}

    def _group_names(self, module: nn.Module, opt: torch.optim.Optimizer) -> list[list[str]]:
        names = {id(p): n for n, p in module.named_parameters()}
        return [[names[id(p)] for p in g["params"]] for g in opt.param_groups]

    def _full_group_names(self, local: list[list[str]]) -> list[list[str]]:
        """The single-device optimizer's groups: each stage's group g merged in model order."""
        everyone: list[Any] = [None] * self.ctx.pp_size
        # every stage shares the parameter names of its optimizer groups with its pipeline
        dist.all_gather_object(everyone, local, group=self.ctx.pp_group)
        order = {n: i for i, n in enumerate(self.full_order)}
        return [
            sorted({n for part in everyone for n in part[g]}, key=order.__getitem__)
            for g in range(len(local))
        ]

    def optimizer_state_to_full(self, module: nn.Module, opt: torch.optim.Optimizer, sd: dict) -> dict:
        """A (tp-gathered) stage-local optimizer state dict -> the single-device one, on pp rank 0."""
        local_names = self._group_names(module, opt)
        flat_local = [n for names in local_names for n in names]
        by_name = {flat_local[idx]: entry for idx, entry in sd["state"].items()}
        full_names = self._full_group_names(local_names)
        parts: list[Any] | None = [None] * self.ctx.pp_size if self.ctx.pp_rank == 0 else None
        # each stage sends its per-parameter optimizer state to pipeline rank 0
        dist.gather_object(by_name, parts, dst=self.ctx.pp_ranks[0], group=self.ctx.pp_group)
        if self.ctx.pp_rank != 0:
            return sd
        merged: dict[str, Any] = {}
        for part in parts:
            for name, entry in part.items():
                merged.setdefault(name, entry)
        flat_full = [n for names in full_names for n in names]
        groups, start = [], 0
        for group, names in zip(sd["param_groups"], full_names, strict=True):
            groups.append({**group, "params": list(range(start, start + len(names)))})
            start += len(names)
        state = {i: merged[n] for i, n in enumerate(flat_full) if n in merged}
        return {**sd, "state": state, "param_groups": groups}

    def optimizer_state_to_local(self, module: nn.Module, opt: torch.optim.Optimizer, sd: dict) -> dict:
        """The single-device optimizer state dict -> this stage's indices (tp slicing comes after)."""
        local_names = self._group_names(module, opt)
        full_names = self._full_group_names(local_names)
        full_index = {n: i for i, n in enumerate(n for names in full_names for n in names)}
        flat_local = [n for names in local_names for n in names]
        state = {
            i: sd["state"][full_index[n]] for i, n in enumerate(flat_local) if full_index[n] in sd["state"]
        }
        groups, start = [], 0
        for group, names in zip(sd["param_groups"], local_names, strict=True):
            groups.append({**group, "params": list(range(start, start + len(names)))})
            start += len(names)
        return {**sd, "state": state, "param_groups": groups}
