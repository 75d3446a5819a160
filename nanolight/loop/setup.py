"""What `NanoTrainer` assembles before a run: the callback list, the loggers, the seeds."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanolight.callbacks.base import Callback
from nanolight.callbacks.model_checkpoint import ModelCheckpoint
from nanolight.callbacks.progress import RichProgressBar
from nanolight.loggers.base import Logger
from nanolight.loggers.csv_logger import CSVLogger


def build_callbacks(
    callbacks: Any, checkpointing: bool, progress_bar: bool, fast_dev_run: bool
) -> list[Callback]:
    """User callbacks + defaults (ModelCheckpoint, progress bar); checkpointing moved last so it
    saves what every other callback did this step (as Lightning does). ``fast_dev_run`` drops
    checkpointing."""
    cbs = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
    if fast_dev_run:
        cbs = [cb for cb in cbs if not isinstance(cb, ModelCheckpoint)]
    elif checkpointing and not any(isinstance(cb, ModelCheckpoint) for cb in cbs):
        cbs.append(ModelCheckpoint())
    if progress_bar and not any(isinstance(cb, RichProgressBar) for cb in cbs):
        cbs.append(RichProgressBar())
    return [cb for cb in cbs if not isinstance(cb, ModelCheckpoint)] + [
        cb for cb in cbs if isinstance(cb, ModelCheckpoint)
    ]


def build_loggers(logger: Any, default_root_dir: str | Path, fast_dev_run: bool) -> list[Logger]:
    """``True`` -> a CSVLogger; ``False``/None -> none; loggers without a save_dir get the root dir."""
    if fast_dev_run or logger is False or logger is None:
        return []
    loggers = [CSVLogger()] if logger is True else [logger] if isinstance(logger, Logger) else list(logger)
    for lg in loggers:
        lg.set_default_save_dir(default_root_dir)
    return loggers


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
