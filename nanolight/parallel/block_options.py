"""What a strategy does to a model's repeated blocks once they are on their device and cast:
activation checkpointing, then `torch.compile` per block (in that order, so the compiled block
is the recomputing one). One home for both strategies; validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from nanolight.parallel.compile import CompiledBlocks, compile_blocks
from nanolight.parallel.recompute import apply_activation_checkpointing, check_recompute


@dataclass(frozen=True)
class BlockOptions:
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
