"""The repeated blocks of a model (a Llama's decoder layers), as activation checkpointing and
`torch.compile` see them: named by the model's own `pp_plan["layers"]`, indexed globally.

After a pipeline split a stage holds only some blocks, still keyed by their global index
(`pipeline/split.py`), so "every 2nd block" names the same blocks at every layout.
"""

from __future__ import annotations

from torch import nn


def decoder_blocks(module: nn.Module) -> tuple[nn.Module, list[tuple[int, nn.Module]]]:
    """The first submodule of `module` that declares ``pp_plan["layers"]`` (the model), and
    (global index, block) of every block this rank holds; a TypeError naming what is missing."""
    for _, sub in module.named_modules():
        plan = getattr(sub, "pp_plan", None)
        if isinstance(plan, dict) and "layers" in plan:
            container = sub.get_submodule(plan["layers"])
            return sub, [
                (int(name), block) for name, block in container.named_children() if block is not None
            ]
    raise TypeError(
        f"{type(module).__name__} declares no repeated blocks: activation checkpointing and compile act on "
        "the blocks named by a model's `pp_plan['layers']` (e.g. nanolight.models.LlamaForCausalLM); "
        "build such a model in configure_model(), or leave activation_checkpointing='none' and compile=False"
    )
