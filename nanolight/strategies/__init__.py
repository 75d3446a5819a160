"""Strategies: where and how the model runs. See `nanolight.strategies.base` for the interface."""

from nanolight.strategies.base import Strategy
from nanolight.strategies.parallel3d import Parallel3DStrategy
from nanolight.strategies.single_device import SingleDeviceStrategy

__all__ = ["Parallel3DStrategy", "SingleDeviceStrategy", "Strategy"]
