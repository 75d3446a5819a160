"""Precision modes, named as in Lightning: ``32-true``, ``bf16-mixed``, ``bf16-true``.

``bf16-mixed`` keeps parameters, gradients (so gradient accumulation) and optimizer state in
fp32 and runs the forward under ``torch.autocast(bfloat16)``: the safe default for pretraining.
``bf16-true`` casts the parameters themselves (half the memory, no fp32 master weights).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed"}


@dataclass
class Precision:
    """How parameters are stored and how the forward computes."""

    mode: str = "32-true"

    def __post_init__(self) -> None:
        self.mode = _ALIASES.get(self.mode, self.mode)
        if self.mode not in PRECISIONS:
            raise ValueError(f"precision={self.mode!r} is not supported; choose one of {PRECISIONS}")

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast parameters for ``bf16-true``; other modes keep fp32 parameters."""
        if self.mode == "bf16-true":
            module.to(torch.bfloat16)
        return module

    def convert_input(self, batch: Any) -> Any:
        """``bf16-true``: floating-point inputs become bf16 to match the parameters."""
        if self.mode != "bf16-true":
            return batch
        return apply_to_collection(
            batch, torch.Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t
        )

    def autocast(self, device: torch.device) -> AbstractContextManager:
        """Forward context: bf16 autocast for ``bf16-mixed``, nothing otherwise."""
        if self.mode == "bf16-mixed":
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return nullcontext()
