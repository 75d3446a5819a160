"""Strategies: where and how the model runs. See `nanolight.strategies.base` for the interface."""

from nanolight.strategies.base import SingleDeviceStrategy, Strategy
from nanolight.strategies.parallel3d import Parallel3DStrategy

__all__ = ["Parallel3DStrategy", "SingleDeviceStrategy", "Strategy"]
