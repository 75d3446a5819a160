"""Loggers: `Logger` base, `CSVLogger` (metrics.csv) and `WandbLogger`."""

from nanolight.loggers.base import Logger
from nanolight.loggers.csv_logger import CSVLogger
from nanolight.loggers.wandb_logger import WandbLogger

__all__ = ["CSVLogger", "Logger", "WandbLogger"]
