"""What a strategy does to a model's repeated blocks once they are on their device and cast:
activation checkpointing, then `torch.compile` per block, in that order (the compiled block is the
recomputing one). One home for both strategies (`BlockOptions`, validated at construction).

The blocks are a Llama's decoder layers, named by the model's own ``pp_plan["layers"]`` and
indexed globally: after a pipeline split a stage holds only some, still keyed by their global
index (`pipeline/split.py`), so "every 2nd block" names the same blocks at every layout. Both
options act on the instance (its ``forward``, ``nn.Module.compile``), so module names, hooks and
state-dict keys stay the plain model's. Order in the strategies' `setup_module`: tensor
parallelism, the pipeline split, these, then data parallelism around the optimizer.

Activation checkpointing trades recomputation for activation memory:

    none        every block keeps what autograd saves (the default)
    full        a block keeps only its input; its forward is re-run in backward
    selective   a block keeps the outputs of its matmuls and of the fused attention kernels, and
                re-runs the cheap rest in backward: norms, RoPE, activations, residual adds,
                casts, and eager attention's score / softmax matrices (torchtitan's op-level
                policy, rewritten here: `_keep`)

`every=k` applies the mode to blocks 0, k, 2k, ... only; the others keep everything. Nothing
numeric changes: a recomputed forward is the same ops on the same inputs (tests compare losses to
1e-6 with and without it), and recomputation re-runs the block's tp collectives in the same order
on every rank. The block's ``forward`` runs through `torch.utils.checkpoint` (non-reentrant).

`torch.compile` compiles each block rather than the whole model (torchtitan's choice): the blocks
are identical, so one compiled graph serves them all (dynamo inlines nn.Modules and treats their
parameters as inputs), compile time does not grow with depth, and what surrounds the blocks --
the embedding, the fused head + loss, the pipeline's sends and receives, the dp reduction's hooks
-- stays eager. Compilation happens at the first forward; a forward hook on the model then reports
how many graphs dynamo made and every graph break with its reason (`CompiledBlocks.graph_breaks`),
as info when there is none, as a warning otherwise.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")
log = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------------------- recompute
_aten = torch.ops.aten
# what `selective` keeps: matmul outputs (the projections: aten.mm under F.linear) and the fused
# attention kernels (expensive to re-run, small outputs). bmm (eager attention's (T, T) scores) and
# everything elementwise is recomputed.
_KEEP_NAMES = (
    "mm",
    "addmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
_KEEP = {getattr(_aten, n).default for n in _KEEP_NAMES if hasattr(_aten, n)}


def check_recompute(mode: str, every: int = 1) -> None:
    """Fail at construction with the valid choices, not at the first backward."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not one of {list(MODES)}")
    if not isinstance(every, int) or every < 1:
        raise ValueError(
            f"activation_checkpointing_every={every!r} must be an integer >= 1 (1: every block, 2: every 2nd ...)"
        )


def _keep(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    flash = getattr(torch.ops, "flash_attn", None)  # the flash-attn package's kernels, when installed
    if op in _KEEP or (flash is not None and "flash_attn" in str(op) and "forward" in str(op)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_keep)


def _recomputed(forward: Callable, context_fn: Callable | None) -> Callable:
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}

    def run(*args: Any, **kw: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs, **kw)

    return run


def apply_activation_checkpointing(module: nn.Module, mode: str = "none", every: int = 1) -> list[int]:
    """Checkpoint `module`'s decoder blocks per `mode`; returns the global indices of the blocks
    that recompute (empty for "none"). Apply once, before `compile_blocks`."""
    check_recompute(mode, every)
    if mode == "none":
        return []
    context_fn = _selective_contexts if mode == "selective" else None
    done = []
    for index, block in decoder_blocks(module)[1]:
        if index % every:
            continue
        if getattr(block, "_recompute", None) is not None:
            raise RuntimeError(f"block {index} already has activation checkpointing ({block._recompute})")
        block.forward = _recomputed(block.forward, context_fn)  # the instance's, not the class's
        block._recompute = mode
        done.append(index)
    return done


# ------------------------------------------------------------------------------------ compile
def _counters() -> tuple[Counter, int]:
    from torch._dynamo.utils import counters  # dynamo's process-wide tallies

    return Counter(counters["graph_break"]), int(counters["stats"]["unique_graphs"])


@dataclass
class CompiledBlocks:
    """What `compile_blocks` did: the compiled blocks' global indices and, after the first
    forward, the graphs dynamo made and the graph breaks (reason -> count) during it."""

    indices: list[int]
    graphs: int | None = None
    graph_breaks: dict[str, int] | None = None
    announce: bool = True  # log the report (one rank does)
    _before: tuple[Counter, int] = field(default_factory=lambda: (Counter(), 0), repr=False)

    def _report(self, model: nn.Module, args: Any, output: Any) -> None:
        breaks, graphs = _counters()
        self.graph_breaks = dict(breaks - self._before[0])
        self.graphs = graphs - self._before[1]
        self._hook.remove()
        what = f"torch.compile: {len(self.indices)} decoder blocks, {self.graphs} graph(s)"
        if not self.announce:
            return
        if self.graph_breaks:
            listed = "; ".join(f"{n}x {reason}" for reason, n in self.graph_breaks.items())
            warnings.warn(f"{what}, graph breaks: {listed}", stacklevel=2)
        else:
            log.info(f"{what}, no graph break")


def compile_blocks(module: nn.Module, announce: bool = True, **options: Any) -> CompiledBlocks:
    """Compile each decoder block of `module` in place (`options`: `torch.compile`'s, e.g.
    ``mode="max-autotune"``); returns the record that the first forward completes. `announce`:
    log it (the strategies pass True on global rank 0 only)."""
    model, blocks = decoder_blocks(module)
    for _, block in blocks:
        block.compile(**options)
    record = CompiledBlocks([i for i, _ in blocks], announce=announce, _before=_counters())
    record._hook = model.register_forward_hook(record._report)  # the model itself stays eager
    return record


@dataclass(frozen=True)
class BlockOptions:
    """A strategy's options for the blocks: recompute, then compile (see the module docstring)."""

    activation_checkpointing: str = "none"  # "none" | "full" | "selective"
    activation_checkpointing_every: int = 1  # on every k-th block (global index)
    compile: bool = False

    def __post_init__(self) -> None:
        check_recompute(self.activation_checkpointing, self.activation_checkpointing_every)

    @property
    def recompute(self) -> tuple[str, int]:
        return self.activation_checkpointing, self.activation_checkpointing_every

    def apply(self, module: nn.Module, announce: bool = True) -> CompiledBlocks | None:
        """Recompute, then compile, `module`'s blocks in place; the compile record (or None)."""
        apply_activation_checkpointing(module, *self.recompute)
        return compile_blocks(module, announce) if self.compile else None
