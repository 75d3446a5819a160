"""Loggers: `Logger` base, `CSVLogger` (metrics.csv) and `WandbLogger`."""

from typing import Any

from nanolight.errors import missing_name
from nanolight.loggers.base import Logger
from nanolight.loggers.csv_logger import CSVLogger
from nanolight.loggers.wandb_logger import WandbLogger

__all__ = ["CSVLogger", "Logger", "WandbLogger"]


def __getattr__(name: str) -> Any:
    """Lightning's names nanolight lacks fail with what to use instead (`errors.LIGHTNING_ONLY`)."""
    raise missing_name(__name__, name)
