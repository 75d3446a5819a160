"""When metrics reach the loggers, and at which ``step`` (Lightning's rules, mixed into `NanoTrainer`).

* A training row after each optimizer step when due (`should_log`), at ``step = log_step`` (the
  0-based index of the step: ``global_step - 1``); under manual optimization once per batch.
* An evaluation row at the end of every validation/test pass (not the sanity check), at the
  current ``log_step`` (inside fit: the last finished step's index; after fit: ``global_step``).
* A train epoch row at the epoch's last step (``log_step - 1``, after the epoch's validation row).
Every row gets ``epoch`` unless the caller names its own step. Converting values to floats
syncs the device, so it happens only for rows (never on a step that logs nothing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer


class LogRows:
    """Mixed into `NanoTrainer`."""

    def log_metrics(self: NanoTrainer, metrics: dict[str, Any], step: int | None = None) -> None:
        """Send `metrics` (floats or scalar tensors) to every logger (global rank zero writes);
        callbacks may use it too. Without `step`: the current `log_step`, and an ``epoch`` column."""
        if not self.loggers or not metrics:
            return
        self.metrics.logged_metrics.update(metrics)
        scalars = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        if step is None:
            scalars.setdefault("epoch", self.current_epoch)
            step = self.log_step
        if self.is_global_zero:
            for lg in self.loggers:
                lg.log_metrics(dict(scalars), step)
                lg.save()

    def publish_step(self: NanoTrainer, sync: bool) -> dict[str, torch.Tensor]:
        """A training batch ended: its step values reach callback/logged metrics (`sync`: the
        ``sync_dist`` ones reduced first, one collective)."""
        metrics = self.metrics
        if sync:
            return metrics.publish(metrics.train, on_step=True)
        log, callback, pbar = metrics.train.values(on_step=True)
        metrics.callback_metrics.update(callback)
        metrics.progress_bar_metrics.update(pbar)
        return log

    def step_row(self: NanoTrainer) -> None:
        log = self.publish_step(sync=True)
        if self.should_log or self.config.fast_dev_run:
            self.log_metrics(dict(log))

    def publish_epoch(self: NanoTrainer) -> None:
        """The train epoch's values, before its epoch-end hooks (they read callback_metrics)."""
        self.metrics.publish(self.metrics.train, on_step=False)

    def epoch_row(self: NanoTrainer) -> None:
        log = self.metrics.publish(self.metrics.train, on_step=False)  # + what the hooks logged
        if log:
            self.progress["stepped"] -= 1  # Lightning writes the epoch row at the last step's index
            try:
                self.log_metrics(dict(log))
            finally:
                self.progress["stepped"] += 1
        self.metrics.train.reset()

    def eval_rows(self: NanoTrainer, dataloader_idx: int) -> int:
        """The step of an evaluation's per-batch row: batches seen by this dataloader in this call."""
        n = self._eval_rows.get(dataloader_idx, 0)
        self._eval_rows[dataloader_idx] = n + 1
        return n

    def set_num_batches(self: NanoTrainer, kind: str, limits: list[float], sanity: bool) -> None:
        counts = [int(n) if n != float("inf") else n for n in limits]
        if sanity:
            self.num_sanity_val_batches = counts
        elif kind == "val":
            self.num_val_batches = counts
        elif kind == "test":
            self.num_test_batches = counts
        else:
            self.num_predict_batches = counts
