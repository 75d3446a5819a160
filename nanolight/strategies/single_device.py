"""`SingleDeviceStrategy`: one process on one CPU or one GPU -- the base defaults, plus a device."""

from __future__ import annotations

import torch
from torch import nn

from nanolight.checkpoint.save import ExportExtras
from nanolight.parallel.blocks import BlockOptions, CompiledBlocks
from nanolight.precision import Precision
from nanolight.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Train on ``device`` (default: ``cuda:0`` if available, else CPU).

    `activation_checkpointing` ("none" | "full" | "selective", on every
    `activation_checkpointing_every`-th decoder block) and `compile` (each decoder block) act on
    the model's blocks after it is moved and cast (`parallel/blocks.py`). `export`: what
    the run adds to each checkpoint so it exports complete (`ExportExtras`).
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        precision: str | Precision = "32-true",
        *,
        activation_checkpointing: str = "none",
        activation_checkpointing_every: int = 1,
        compile: bool = False,
        export: ExportExtras | None = None,
    ):
        super().__init__(precision, export)
        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)
        self.blocks = BlockOptions(activation_checkpointing, activation_checkpointing_every, compile)
        self.compiled: CompiledBlocks | None = None  # set by setup_module when compiling

    @property
    def root_device(self) -> torch.device:
        return self._device

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        self.compiled = self.blocks.apply(module)
        return module

    def setup_environment(self) -> None:
        super().setup_environment()
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)

    def teardown(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
