"""Topology-independent initialisation: a shard holds exactly its slice of the unsharded init.

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

import torch
from torch import nn


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
    kept = dict(model.named_parameters())
    for name, shape in specs:
        full = torch.empty(shape, dtype=torch.float32)  # on CPU: the CPU generator's stream
        model.init_param(name, full, generator)
        if name not in kept:
            continue  # another stage's parameter: drawn only to keep the stream aligned
        dim = tp_dims.get(name)
        local = full if dim is None else full.chunk(tp_size, dim=dim)[tp_rank]
        with torch.no_grad():
            kept[name].copy_(local)
