"""Cutting a model built whole (or on the meta device) into this rank's part, in the documented
order: record the full model (shapes, tied names, init order), apply its `tp_plan`, cut its
pipeline chunks out, materialise what is left. What happens to the shards next (init replay,
pretrained load, recompute, compile) is the strategy's sequence; the layout every later concern
reads (`ModelLayout`) is made here.

Topology-independent initialisation (`init_replayed_`): a shard holds exactly its slice of the
unsharded init.

Why: "the same seed gives the same run at every layout". If each tp rank drew its shard from its
own RNG stream, tp=2 and tp=4 would start from different weights and no loss curve could be
compared across layouts. So every rank replays the *unsharded, unsplit* model's init: for each
parameter of the full model (`specs`, in ``named_parameters()`` order, the order
`LlamaForCausalLM.init_weights` uses), draw the full tensor on CPU from one generator, keep this
rank's slice if this stage holds the parameter, drop the rest. Parameters of other pipeline
stages are drawn too, only to keep the stream aligned. With the same generator seed this
reproduces ``model.init_weights(generator)`` of the plain model bit for bit.

Memory/time trade-off: each rank holds one full parameter at a time in CPU memory (the
embedding, V x H, is the largest: 400 MB fp32 for SmolLM-1.7B) and draws every parameter
(about 10 s of CPU for 1.7B). Sharded RNG tricks would avoid both but tie the result to the
layout; for the model sizes nanolight targets, replaying is the simplest correct choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nanolight.models.llama import materialise_
from nanolight.parallel.config import ParallelConfig
from nanolight.parallel.context import ParallelContext
from nanolight.parallel.layout import ModelLayout, tied_aliases
from nanolight.parallel.pipeline import PipelineSplit, apply_split, plan_split
from nanolight.parallel.tensor_parallel.apply import apply_tensor_parallel, shard_chunks
from nanolight.parallel.tensor_parallel.layers import shard_of


@dataclass
class ShardedModel:
    layout: ModelLayout
    split: PipelineSplit | None  # None without pipeline parallelism
    on_meta: bool  # built on the meta device: its shards still need their initial values
    specs: list[tuple[str, tuple[int, ...]]]  # the unsplit model's init order (what `init_replayed_` replays)


def find_plan_model(module: nn.Module, required: bool) -> tuple[nn.Module | None, str]:
    """The (first) submodule that declares a tensor-parallel plan, and its state-dict key prefix."""
    for name, sub in module.named_modules():
        if isinstance(getattr(sub, "tp_plan", None), dict):
            return sub, f"{name}." if name else ""
    if not required:
        return None, ""
    raise TypeError(
        f"Parallel3DStrategy found no model with a `tp_plan` inside {type(module).__name__}; build one "
        "(e.g. nanolight.models.LlamaForCausalLM) in configure_model()"
    )


def shard_model(
    module: nn.Module,
    model: nn.Module,
    prefix: str,
    ctx: ParallelContext,
    cfg: ParallelConfig,
    device: torch.device,
    layers_per_stage: list[int] | None = None,
) -> ShardedModel:
    """This rank's tp slices of its pipeline chunks of `model` (inside `module`, at `prefix`),
    on `device`."""
    if getattr(model, "config", None) is not None:
        c = model.config
        cfg.check_model(c.num_attention_heads, c.num_key_value_heads, c.vocab_size)
    # the unsharded, unsplit model: what a checkpoint's global tensors and the init replay match
    full_shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    aliases, specs = tied_aliases(module), param_specs(model)
    on_meta = any(p.is_meta for p in module.parameters())
    pp = ctx.pp_size
    split = plan_split(model, pp, layers_per_stage, cfg.pp_virtual) if pp > 1 else None
    apply_tensor_parallel(model, model.tp_plan, ctx.tp_group, cfg.sequence_parallel)
    if split is not None:
        apply_split(model, split, ctx.pp_rank)  # drop other stages' modules before allocating
    if on_meta:
        materialise_(module, device)
        model.tie_weights()  # new Parameter objects: the tied ones are separate until re-tied
    elif any(t.device != device for t in [*module.parameters(), *module.buffers()]):
        module.to(device)  # built materialised: apply_tensor_parallel already copied each rank's slice
    layout = ModelLayout.sharded(module, full_shapes, aliases, ctx, split, prefix)
    return ShardedModel(layout, split, on_meta, specs)


def replicated_layout(module: nn.Module, ctx: ParallelContext) -> ModelLayout:
    """dp alone, a model without a tp/pp plan: every rank holds it whole."""
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    return ModelLayout.sharded(module, shapes, tied_aliases(module), ctx, None, "")


def broadcast_replicas(module: nn.Module, ctx: ParallelContext) -> None:
    """A model each rank built itself starts from its replica rank 0's weights (DDP's rule: replicas
    that were seeded differently must not silently diverge; cp ranks are replicas too)."""
    if ctx.size("replica") == 1:
        return
    group = ctx.group("replica")
    src = dist.get_global_rank(group, 0)
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=src, group=group)  # replica rank 0 sends its shard's weights


def param_specs(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, full shape) of every parameter, in init order: record it before sharding/splitting."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def init_replayed_(
    model: nn.Module,
    specs: list[tuple[str, tuple[int, ...]]],
    generator: torch.Generator,
    tp_dims: dict[str, int | None],
    tp_rank: int = 0,
    tp_size: int = 1,
) -> None:
    """Initialise the parameters `model` holds (tp-sharded along `tp_dims`, maybe one pipeline
    stage) exactly as the full model of `specs` would be. `model` must offer
    ``init_param(name, full_tensor, generator)`` (as `LlamaForCausalLM` does)."""
    if not hasattr(model, "init_param"):
        raise TypeError(
            f"{type(model).__name__} has no init_param(name, tensor, generator); cannot init by name"
        )
    kept, chunks = dict(model.named_parameters()), shard_chunks(model)
    for name, shape in specs:
        full = torch.empty(shape, dtype=torch.float32)  # on CPU: the CPU generator's stream
        model.init_param(name, full, generator)
        if name not in kept:
            continue  # another stage's parameter: drawn only to keep the stream aligned
        dim = tp_dims.get(name)
        local = full if dim is None else shard_of(full, dim, tp_rank, tp_size, chunks.get(name, 1))
        with torch.no_grad():
            kept[name].copy_(local)
