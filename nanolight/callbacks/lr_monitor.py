"""`LearningRateMonitor`: logs the learning rate each optimizer step used (column ``lr``)."""

from __future__ import annotations

from typing import Any

import torch

from nanolight.callbacks.base import Callback


class LearningRateMonitor(Callback):
    """Logs ``lr`` (first param group of the first optimizer); with ``log_all_groups`` also
    ``lr/opt{i}-pg{j}`` for every group. The value is read just before the optimizer step, i.e.
    the rate that step applied (schedulers step afterwards)."""

    def __init__(self, log_all_groups: bool = False) -> None:
        self.log_all_groups = log_all_groups
        self._pending: dict[str, float] = {}

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        i = trainer.optimizers.index(optimizer)
        if i == 0:
            self._pending = {"lr": float(optimizer.param_groups[0]["lr"])}
        if self.log_all_groups:
            for j, group in enumerate(optimizer.param_groups):
                self._pending[f"lr/opt{i}-pg{j}"] = float(group["lr"])

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._pending:  # set by this step's on_before_optimizer_step: the step has ended
            trainer.callback_metrics.update({k: torch.tensor(v) for k, v in self._pending.items()})
            if trainer.should_log:
                trainer.log_metrics(self._pending)
            self._pending = {}
