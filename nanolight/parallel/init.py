"""Topology-independent initialisation: a shard holds exactly its slice of the unsharded init.

Why: "the same seed gives the same run at every layout". If each tp rank drew its shard from
its own RNG stream, tp=2 and tp=4 would start from different weights and no loss curve could
be compared across layouts. So every rank replays the *unsharded* model's init: for each
parameter, in `named_parameters()` order (the order `LlamaForCausalLM.init_weights` uses),
draw the full tensor on CPU from one generator, keep this rank's slice, drop the rest. With
the same generator seed this reproduces `model.init_weights(generator)` of the plain model
bit for bit.

Memory/time trade-off: each rank holds one full parameter at a time in CPU memory (the
embedding, V x H, is the largest: 400 MB fp32 for SmolLM-1.7B) and draws every parameter
(about 10 s of CPU for 1.7B). Sharded RNG tricks would avoid both but tie the result to the
layout; for the model sizes nanolight targets, replaying is the simplest correct choice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanolight.parallel.tensor_parallel import comm
from nanolight.parallel.tensor_parallel.apply import shard_dims


def init_sharded_(model: nn.Module, generator: torch.Generator, group: Any | None = None) -> None:
    """Initialise a (possibly tp-sharded, materialised) model in place from `generator`.

    `model` must offer `init_param(name, full_tensor, generator)` (as `LlamaForCausalLM`
    does) for its parameter names. `group` is the tp group (None: unsharded model).
    """
    if not hasattr(model, "init_param"):
        raise TypeError(
            f"{type(model).__name__} has no init_param(name, tensor, generator); cannot init by name"
        )
    rank, size = comm.tp_world(group) if group is not None else (0, 1)
    dims = shard_dims(model)
    for name, param in model.named_parameters():  # tied weights appear once, as in init_weights
        dim = dims[name]
        shape = list(param.shape)
        if dim is not None:
            shape[dim] *= size
        full = torch.empty(shape, dtype=torch.float32)  # on CPU: the CPU generator's stream
        model.init_param(name, full, generator)
        local = full if dim is None else full.chunk(size, dim=dim)[rank]
        with torch.no_grad():
            param.copy_(local)
