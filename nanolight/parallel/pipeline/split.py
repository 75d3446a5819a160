"""Cut a plain causal LM into pipeline stages by module name, and initialise one stage.

Which stage holds what (the model keeps its module names, so checkpoints load at any layout):

    stage 0        model.embed_tokens + model.layers.{a..b}
    stage 1..p-2   model.layers.{..}
    stage p-1      model.layers.{..} + model.norm + lm_head (+ the loss)
                   (+ model.embed_tokens when embeddings are tied: it *is* lm_head.weight, so
                   keeping the module costs no memory and keeps the parameter's name)

Layers are split into contiguous runs balanced by cost (`balanced_layer_split`): a decoder
layer costs its parameter count (≈ its matmul FLOPs per token / 2), the output head costs
hidden * vocab on the last stage. An explicit `layers_per_stage` overrides the balance.

A dropped module is set to None (`nn.Module` then skips it in `named_parameters` and
`state_dict`); the decoder layers become a `StageLayers` dict keyed by their global index,
so a kept layer is still `model.layers.5`. Splitting runs on the meta device, before
materialisation, so a rank never allocates other stages' weights (memory ~ 1/pp).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanolight.parallel.tensor_parallel.apply import shard_dims


class StageLayers(nn.ModuleDict):
    """The decoder layers one stage owns, keyed by their global index ("5" -> model.layers.5).

    Iterating yields the layers (like the `nn.ModuleList` it replaces), in index order.
    """

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


def check_pipeline_layout(pp: int, num_layers: int) -> None:
    """Raise ValueError with a fix-it message if the model cannot be cut into `pp` stages."""
    if pp > num_layers:
        raise ValueError(
            f"pipeline parallelism pp={pp} is larger than the model's num_hidden_layers={num_layers}: "
            f"every stage needs at least one decoder layer; choose pp <= {num_layers}"
        )


def check_micro_batches(pp: int, schedule: str, micro_batches: int) -> None:
    """1F1B needs at least pp micro-batches per step to reach its steady phase; say so clearly."""
    if pp > 1 and schedule == "1f1b" and micro_batches < pp:
        raise ValueError(
            f"the 1F1B schedule needs at least pp={pp} micro-batches per optimizer step, got "
            f"accumulate_grad_batches={micro_batches}: with fewer, stages idle most of the step "
            f"(bubble (p-1)/(m+p-1) = {(pp - 1) / (micro_batches + pp - 1):.0%}). Set "
            f"trainer.accumulate_grad_batches >= {pp} (4*pp or more keeps the bubble small) or "
            "use pp_schedule='afab'"
        )


def balanced_layer_split(
    num_layers: int,
    pp: int,
    layer_cost: float = 1.0,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
    layers_per_stage: Sequence[int] | None = None,
) -> list[range]:
    """Contiguous layer ranges per stage minimising the costliest stage (the pipeline's pace).

    `first_extra` / `last_extra` are the embedding's / head's costs in the same units as
    `layer_cost`. Exact dynamic programme over split points: O(pp * L^2), trivial for L <= 1000.
    """
    check_pipeline_layout(pp, num_layers)
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"layers_per_stage={counts} must list {pp} positive layer counts summing to "
                f"num_hidden_layers={num_layers}"
            )
    else:
        counts = _min_max_partition(num_layers, pp, layer_cost, first_extra, last_extra)
    starts = [sum(counts[:s]) for s in range(pp)]
    return [range(a, a + n) for a, n in zip(starts, counts, strict=True)]


def _min_max_partition(L: int, pp: int, cost: float, first: float, last: float) -> list[int]:
    """Layer counts per stage (each >= 1) minimising the max stage cost; ties favour earlier
    stages holding fewer layers (they also hold more in-flight activations under 1F1B)."""

    def stage_cost(s: int, n: int) -> float:
        return n * cost + (first if s == 0 else 0.0) + (last if s == pp - 1 else 0.0)

    # best[s][k]: (max cost, counts) placing the first k layers on stages 0..s
    best: list[dict[int, tuple[float, list[int]]]] = [{} for _ in range(pp)]
    for k in range(1, L - pp + 2):
        best[0][k] = (stage_cost(0, k), [k])
    for s in range(1, pp):
        for k in range(s + 1, L - (pp - 1 - s) + 1):
            options = []
            for n in range(1, k - s + 1):
                prev_cost, prev_counts = best[s - 1][k - n]
                options.append((max(prev_cost, stage_cost(s, n)), -n, prev_counts + [n]))
            c, _, counts = min(options, key=lambda o: (o[0], o[1]))
            best[s][k] = (c, counts)
    return best[pp - 1][L][1]


def llama_stage_costs(config: Any) -> tuple[float, float, float]:
    """(layer, embedding, head) costs of a Llama config in parameter units (≈ FLOPs/token / 2)."""
    h, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    n_q, n_kv = config.num_attention_heads, config.num_key_value_heads
    layer = h * (n_q + 2 * n_kv) * hd + n_q * hd * h + 3 * h * i
    return float(layer), 0.0, float(h * config.vocab_size)  # a lookup costs no matmul


def split_causal_lm(lm: nn.Module, pp_rank: int, pp_size: int, layers: range) -> nn.Module:
    """Drop from `lm` (a LlamaForCausalLM, ideally on meta) every module not on this stage."""
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    tied = bool(getattr(lm.config, "tie_word_embeddings", False))
    old = lm.model.layers
    lm.model.layers = StageLayers({str(i): old[i] for i in layers})
    if not first and not (last and tied):
        lm.model.embed_tokens = None
    if not last:
        lm.model.norm = None
        lm.lm_head = None
    return lm


def tie_stage_weights(lm: nn.Module) -> None:
    """Re-tie lm_head to the embedding where a stage holds both (materialising made new Parameters)."""
    if getattr(lm.config, "tie_word_embeddings", False) and lm.lm_head is not None:
        if lm.model.embed_tokens is not None:
            lm.lm_head.weight = lm.model.embed_tokens.weight


def param_specs(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, full shape) of every parameter of the *unsplit, unsharded* model, in init order."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def init_stage_(
    model: nn.Module,
    specs: list[tuple[str, tuple[int, ...]]],
    generator: torch.Generator,
    tp_group: Any | None = None,
) -> None:
    """Initialise a split (and maybe tp-sharded) model exactly as the unsplit model would be.

    Why not `init_sharded_`: it draws only the parameters the model holds, so after a split the
    generator stream would shift and every later parameter would differ from the single-device
    init. Here every rank replays *all* parameters of the full model (`specs`, in
    `named_parameters()` order) and keeps the ones its stage owns (its tp slice of them).
    """
    rank, size = (0, 1) if tp_group is None else (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    kept = dict(model.named_parameters())
    dims = shard_dims(model)
    for name, shape in specs:
        full = torch.empty(shape, dtype=torch.float32)  # CPU: the CPU generator's stream
        model.init_param(name, full, generator)
        if name not in kept:
            continue  # another stage's parameter: drawn only to keep the stream aligned
        dim = dims[name]
        local = full if dim is None else full.chunk(size, dim=dim)[rank]
        with torch.no_grad():
            kept[name].copy_(local)
