"""`EarlyStopping`: Lightning 2.6's callback; stop ``fit`` when a monitored metric stops improving.

Arguments, defaults, timing, messages and state follow Lightning (see its docs): the check runs
after each validation, or at the train epoch end when validation runs exactly once per epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor

from nanolight.callbacks.base import Callback, info
from nanolight.errors import UsageError


class EarlyStoppingReason(Enum):
    """Why training was stopped (Lightning's values)."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


class EarlyStopping(Callback):
    """Monitor `monitor` in ``trainer.callback_metrics``; see the module docstring.

    Attributes: ``best_score`` (tensor), ``wait_count``, ``stopped_epoch`` (0 if not stopped),
    ``stopping_reason`` and ``stopping_reason_message`` (the human sentence, or None)."""

    mode_dict: dict[str, Callable[..., Tensor]] = {"min": torch.lt, "max": torch.gt}
    order_dict = {"min": "<", "max": ">"}

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        log_rank_zero_only: bool = False,
    ) -> None:
        if mode not in self.mode_dict:
            raise UsageError(f"EarlyStopping(mode={mode!r}): mode can be 'min' or 'max'")
        self.monitor, self.patience, self.verbose, self.mode = monitor, patience, verbose, mode
        self.strict, self.check_finite = strict, check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self._check_on_train_epoch_end = check_on_train_epoch_end
        self.log_rank_zero_only = log_rank_zero_only
        # an improvement is `current - min_delta` beating the best: negative for "min", positive for "max"
        self.min_delta = min_delta * (1 if self.monitor_op == torch.gt else -1)
        self.best_score = torch.tensor(torch.inf if self.monitor_op == torch.lt else -torch.inf)
        self.wait_count = 0
        self.stopped_epoch = 0
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None

    @property
    def monitor_op(self) -> Callable[..., Tensor]:
        return self.mode_dict[self.mode]

    @property
    def state_key(self) -> str:
        return f"{type(self).__qualname__}{ {'monitor': self.monitor, 'mode': self.mode}!r}"

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._check_on_train_epoch_end is None:
            # validating several times per epoch, or not every epoch: check after validation
            self._check_on_train_epoch_end = (
                trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1
            )

    def _should_skip_check(self, trainer: Any) -> bool:
        return trainer.state.fn != "fit" or trainer.sanity_checking

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._check_on_train_epoch_end and not self._should_skip_check(trainer):
            self._run_early_stopping_check(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not self._check_on_train_epoch_end and not self._should_skip_check(trainer):
            self._run_early_stopping_check(trainer)

    def _validate_condition_metric(self, logs: dict[str, Tensor]) -> bool:
        if self.monitor in logs:
            return True
        message = (
            f"Early stopping conditioned on metric `{self.monitor}` which is not available. Pass in or "
            f"modify your `EarlyStopping` callback to use any of the following: `{'`, `'.join(logs)}`"
        )
        if self.strict:
            raise RuntimeError(message)
        if self.verbose:
            rank_zero_warn(message, category=RuntimeWarning)
        return False

    def _run_early_stopping_check(self, trainer: Any) -> None:
        logs = trainer.callback_metrics
        if trainer.fast_dev_run or not self._validate_condition_metric(logs):
            return
        current = torch.as_tensor(logs[self.monitor]).squeeze()
        should_stop, reason = self._evaluate_stopping_criteria(current)
        should_stop = bool(trainer.strategy.broadcast(should_stop, src=0))  # every rank stops together
        trainer.should_stop = trainer.should_stop or should_stop
        if should_stop:
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason_message = reason
        if reason and self.verbose:
            rank = trainer.global_rank if trainer.world_size > 1 else None
            info(reason, rank=rank, rank_zero_only=self.log_rank_zero_only)

    def _evaluate_stopping_criteria(self, current: Tensor) -> tuple[bool, str | None]:
        op, best = self.monitor_op, self.best_score.to(current.device)
        if self.check_finite and not torch.isfinite(current):
            self.stopping_reason = EarlyStoppingReason.NON_FINITE_METRIC
            return True, (
                f"Monitored metric {self.monitor} = {current} is not finite. Previous best value was "
                f"{self.best_score:.3f}. Signaling Trainer to stop."
            )
        if self.stopping_threshold is not None and op(current, self.stopping_threshold):
            self.stopping_reason = EarlyStoppingReason.STOPPING_THRESHOLD
            return True, (
                f"Stopping threshold reached: {self.monitor} = {current} {self.order_dict[self.mode]} "
                f"{self.stopping_threshold}. Signaling Trainer to stop."
            )
        if self.divergence_threshold is not None and op(-current, -self.divergence_threshold):
            self.stopping_reason = EarlyStoppingReason.DIVERGENCE_THRESHOLD
            return True, (
                f"Divergence threshold reached: {self.monitor} = {current} {self.order_dict[self.mode]} "
                f"{self.divergence_threshold}. Signaling Trainer to stop."
            )
        if op(current - self.min_delta, best):
            reason = f"Metric {self.monitor} improved. New best score: {current:.3f}"
            if torch.isfinite(self.best_score):
                reason = (
                    f"Metric {self.monitor} improved by {abs(self.best_score - current):.3f} >= min_delta = "
                    f"{abs(self.min_delta)}. New best score: {current:.3f}"
                )
            self.best_score, self.wait_count = current, 0
            return False, reason
        self.wait_count += 1
        if self.wait_count < self.patience:
            return False, None
        self.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
        return True, (
            f"Monitored metric {self.monitor} did not improve in the last {self.wait_count} records. "
            f"Best score: {self.best_score:.3f}. Signaling Trainer to stop."
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "best_score": self.best_score,
            "patience": self.patience,
            "stopping_reason": self.stopping_reason.value,
            "stopping_reason_message": self.stopping_reason_message,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = state_dict["wait_count"]
        self.stopped_epoch = state_dict["stopped_epoch"]
        self.best_score = torch.as_tensor(state_dict["best_score"])
        self.patience = state_dict["patience"]
        reason = state_dict.get("stopping_reason", EarlyStoppingReason.NOT_STOPPED.value)
        self.stopping_reason = EarlyStoppingReason(reason)
        self.stopping_reason_message = state_dict.get("stopping_reason_message")
