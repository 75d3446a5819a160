"""`SingleDeviceStrategy`: one process on one CPU or one GPU -- the base defaults, plus a device."""

from __future__ import annotations

import torch

from nanolight.precision import Precision
from nanolight.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Train on ``device`` (default: ``cuda:0`` if available, else CPU)."""

    def __init__(self, device: str | torch.device | None = None, precision: str | Precision = "32-true"):
        super().__init__(precision)
        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)

    @property
    def root_device(self) -> torch.device:
        return self._device

    def setup_environment(self) -> None:
        super().setup_environment()
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)

    def teardown(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
