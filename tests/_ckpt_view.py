"""Read a Parallel3DStrategy checkpoint (per-rank shards) the way a single device sees it.

Loads it into `module` through NanoTrainer + SingleDeviceStrategy -- the path a user resuming on
one device takes -- and returns the full weights and the torch.optim state dicts, which tests
compare with a single-process run's checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nanolight import NanoModule, NanoTrainer
from nanolight.strategies.single_device import SingleDeviceStrategy


def single_device_view(
    ckpt: Path, module: NanoModule, steps: int
) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """(state_dict, [optimizer.state_dict()]) of checkpoint `ckpt` saved after `steps` steps."""
    trainer = NanoTrainer(
        max_steps=steps, strategy=SingleDeviceStrategy("cpu"), logger=False, enable_progress_bar=False,
        enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=[], ckpt_path=str(ckpt))  # max_steps reached: no step runs
    assert trainer.global_step == steps
    return module.state_dict(), [opt.state_dict() for opt in trainer.optimizers]
