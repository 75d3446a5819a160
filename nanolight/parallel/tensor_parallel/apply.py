"""Apply a model's declarative TP plan to the plain model, and the TP bookkeeping around it.

The model says *what* (`LlamaForCausalLM.tp_plan`: module-name pattern -> "column" | "row" |
"vocab", or ("column", n): output rows that are n equal blocks, each split over tp, e.g. the
MLP's [gate | up] with n=2 -- `layers.shard_of`); this file says *how*:

    style     module becomes                        notes
    vocab     VocabParallelEmbedding                output all-reduced (SP: reduce-scattered on T)
    column    ColumnParallelLinear(no gather)       output stays sharded for the next row layer
    row       RowParallelLinear(input parallel)     output all-reduced (SP: reduce-scattered on T)
    column on the output head (`lm_head`)           logits stay vocab-sharded; `model.loss_fn`
                                                    becomes the vocab-parallel cross-entropy, and
                                                    `model(ids)` without labels gathers the logits

Parameter names do not change, so checkpoints, the optimizer and pipeline split see the same
keys; `shard_dims` tells which dim of each parameter is split, `shard_chunks` into how many
blocks. Everything else (norms) is replicated over tp.

Sequence parallelism: activations between TP regions are (B, T/tp, H) (`comm.token_chunk`). The tokens are
all-gathered on entry to the *parent* of each column layer (`self_attn`, `mlp`) rather than in
the layer, because the parent reads `T` from its input's shape (attention reshapes by it) and
must see the full sequence; the column layer then does no entry collective itself. (The
output head's parent is the model root, so `lm_head` gathers the sequence itself.) Each rank
then runs the norms on its own tokens only, so their replicated weights get partial gradients,
which `parallel/grads.py` sums over tp after backward.

Tied embeddings: the embedding and `lm_head` both split the vocabulary into the same
contiguous rows, so after re-tying, `lm_head` uses the embedding's shard as is.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from nanolight.parallel.tensor_parallel import comm
from nanolight.parallel.tensor_parallel.cross_entropy import VocabParallelCrossEntropyLoss
from nanolight.parallel.tensor_parallel.layers import (
    TP_LAYERS,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_of,
    unshard,
)

STYLES = ("column", "row", "vocab")


def plan_style(value: str | tuple[str, int]) -> tuple[str, int]:
    """A plan entry as (style, chunks): "column" -> ("column", 1); ("column", 2) as is."""
    style, chunks = (value, 1) if isinstance(value, str) else value
    if chunks != 1 and style != "column":
        raise ValueError(f"tensor-parallel plan entry {value!r}: only 'column' splits blocks one by one")
    return style, chunks


def apply_tensor_parallel(
    model: nn.Module,
    plan: Mapping[str, str | tuple[str, int]],
    group: Any,
    sequence_parallel: bool = False,
    output_module: str = "lm_head",
) -> nn.Module:
    """Replace `model`'s modules per `plan` in place (on meta, or copying weight slices) and return it."""
    rank, size = comm.tp_world(group)
    unknown = {p: s for p, s in plan.items() if plan_style(s)[0] not in STYLES}
    if unknown:
        raise ValueError(f"unknown tensor-parallel style(s) {unknown}; valid styles are {STYLES}")
    matched: set[str] = set()
    sp_entries: set[str] = set()  # parents that all-gather the sequence for their column layers
    for name, module in list(model.named_modules()):
        pattern = next((p for p in plan if fnmatch.fnmatchcase(name, p)), None)
        if pattern is None:
            continue
        matched.add(pattern)
        parent = name.rpartition(".")[0]
        style, chunks = plan_style(plan[pattern])
        gathered_by_parent = sequence_parallel and style == "column" and parent != ""
        if gathered_by_parent:
            sp_entries.add(parent)
        new = _parallel_twin(module, style, chunks, group, sequence_parallel, gathered_by_parent)
        _copy_slice(module, new, rank, size)
        model.set_submodule(name, new)
    missing = sorted(set(plan) - matched)
    if missing:
        raise ValueError(
            f"tensor-parallel plan pattern(s) {missing} match no module of {type(model).__name__}"
        )
    for parent in sorted(sp_entries):
        model.get_submodule(parent).register_forward_pre_hook(_GatherSequence(group))
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # lm_head shares the vocab-parallel embedding's shard (same vocab rows)
    if output_module in dict(model.named_modules()) and hasattr(model, "loss_fn"):
        model.loss_fn = VocabParallelCrossEntropyLoss(group)
        model.register_forward_hook(_GatherLogits(group), with_kwargs=True)
    return model


def _parallel_twin(
    module: nn.Module, style: str, chunks: int, group: Any, sp: bool, gathered_by_parent: bool
) -> nn.Module:
    """The TP layer replacing `module`, on the same device and dtype as its weight."""
    w = module.weight
    kw = {"device": w.device, "dtype": w.dtype}
    if style == "vocab":
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"'vocab' style needs an nn.Embedding, got {type(module).__name__}")
        return VocabParallelEmbedding(
            module.num_embeddings, module.embedding_dim, group, sequence_parallel=sp, **kw
        )
    if not isinstance(module, nn.Linear) or module.bias is not None:
        raise TypeError(f"'{style}' style needs a bias-free nn.Linear, got {module!r}")
    if style == "column":
        return ColumnParallelLinear(
            module.in_features,
            module.out_features,
            group,
            sequence_parallel=sp,
            input_is_gathered=gathered_by_parent,
            chunks=chunks,
            **kw,
        )
    return RowParallelLinear(module.in_features, module.out_features, group, sequence_parallel=sp, **kw)


def _copy_slice(dense: nn.Module, parallel: nn.Module, rank: int, size: int) -> None:
    """Give a TP layer built from a materialised dense layer exactly its slice of the weight."""
    if dense.weight.is_meta:
        return
    with torch.no_grad():
        parallel.weight.copy_(shard_of(dense.weight, parallel.tp_shard_dim, rank, size, parallel.tp_chunks))


class _GatherSequence:
    """Forward pre-hook: gather the token chunks of the first positional input (B, T/tp, H)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        return (comm.gather_from_sp(args[0], self.group), *args[1:])


class _GatherLogits:
    """Forward hook: without labels (or target_ids) the model returns logits; gather their vocab shards."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        labels = kwargs.get("labels", args[1] if len(args) > 1 else None)
        if (
            labels is None
            and kwargs.get("target_ids") is None
            and isinstance(output, Tensor)
            and output.dim() >= 2
        ):
            return comm.gather_from_tp(output, self.group)  # tp ranks exchange vocab slices
        return output


def shard_dims(model: nn.Module, remove_duplicate: bool = True) -> dict[str, int | None]:
    """Parameter name -> the dim split over tp (None: replicated).

    Tied parameters appear once (as in `named_parameters()`), unless `remove_duplicate=False`,
    which lists every alias (as `state_dict()` keys do).
    """
    owner = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for p_name, _ in mod.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            owner[full] = mod.tp_shard_dim if isinstance(mod, TP_LAYERS) else None
    return {name: owner[name] for name, _ in model.named_parameters(remove_duplicate=remove_duplicate)}


def shard_chunks(model: nn.Module) -> dict[str, int]:
    """Parameter name -> the blocks its tp dim is split in one by one (`layers.shard_of`), for the
    parameters with more than one (every other sharded parameter: one contiguous slice)."""
    return {
        f"{mod_name}.weight" if mod_name else "weight": mod.tp_chunks
        for mod_name, mod in model.named_modules(remove_duplicate=False)
        if isinstance(mod, TP_LAYERS) and mod.tp_chunks > 1
    }


def gather_full(tensor: Tensor, dim: int | None, group: Any, chunks: int = 1) -> Tensor:
    """The unsharded tensor, on every tp rank (tp ranks exchange their shards)."""
    if dim is None:
        return tensor
    gathered = comm.all_gather_tensor(tensor.detach(), dim, group)  # tp ranks exchange their shards
    if chunks == 1:
        return gathered.contiguous()
    return unshard(list(gathered.chunk(comm.tp_world(group)[1], dim=dim)), dim, chunks)


def take_shard(full: Tensor, dim: int | None, group: Any, chunks: int = 1) -> Tensor:
    """This rank's shard of an unsharded tensor (no communication)."""
    if dim is None:
        return full
    rank, size = comm.tp_world(group)
    return shard_of(full, dim, rank, size, chunks)
