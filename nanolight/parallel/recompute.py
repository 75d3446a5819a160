"""Activation checkpointing of the decoder blocks: trade recomputation for activation memory.

    none        every block keeps what autograd saves (the default)
    full        a block keeps only its input; its forward is re-run in backward
    selective   a block keeps the outputs of its matmuls and of the fused attention kernels, and
                re-runs the cheap rest in backward: norms, RoPE, activations, residual adds,
                casts, and eager attention's score / softmax matrices (torchtitan's op-level
                policy, rewritten here: `_keep`)

`every=k` applies the mode to blocks 0, k, 2k, ... only (global indices, the same blocks at every
layout); the others keep everything. Nothing numeric changes: a recomputed forward is the same
ops on the same inputs (tests compare losses to 1e-6 with and without it).

How: the block's ``forward`` is replaced *on the instance* by one that runs the original through
`torch.utils.checkpoint` (non-reentrant), so module names, hooks and state-dict keys stay the
plain model's, and a later `torch.compile` of the block (`compile.py`) traces the checkpoint.
Applied after tensor parallelism (recomputation re-runs the block's tp collectives in the same
order on every rank) and the pipeline split, before data parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from nanolight.parallel.blocks import decoder_blocks

MODES = ("none", "full", "selective")

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


__all__ = ["MODES", "apply_activation_checkpointing", "check_recompute"]
