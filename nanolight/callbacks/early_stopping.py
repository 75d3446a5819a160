"""`EarlyStopping`: stop when a monitored metric stops improving (checked after validation)."""

from __future__ import annotations

import math
from typing import Any

from nanolight.callbacks.base import Callback


class EarlyStopping(Callback):
    """Sets ``trainer.should_stop`` after ``patience`` checks without an improvement larger than
    ``min_delta``; checked at ``on_validation_end`` (or ``on_train_epoch_end`` when
    ``check_on_train_epoch_end``). A non-finite value stops at once when ``check_finite``."""

    def __init__(
        self,
        monitor: str,
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        check_finite: bool = True,
        check_on_train_epoch_end: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.monitor, self.mode, self.patience = monitor, mode, patience
        self.min_delta, self.check_finite = abs(min_delta), check_finite
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.best = math.inf if mode == "min" else -math.inf
        self.wait_count = 0
        self.stopped_step: int | None = None
        self.reason = ""

    @property
    def state_key(self) -> str:
        return f"EarlyStopping[{self.monitor}]"

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not self.check_on_train_epoch_end:
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.check_on_train_epoch_end:
            self._check(trainer)

    def _improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def _check(self, trainer: Any) -> None:
        if self.monitor not in trainer.callback_metrics:
            raise KeyError(
                f"EarlyStopping(monitor={self.monitor!r}) but it was not logged; "
                f"logged: {sorted(trainer.callback_metrics)}"
            )
        value = float(trainer.callback_metrics[self.monitor])
        if self.check_finite and not math.isfinite(value):
            self._stop(trainer, f"{self.monitor}={value} is not finite")
        elif self._improved(value):
            self.best, self.wait_count = value, 0
        else:
            self.wait_count += 1
            if self.wait_count >= self.patience:
                self._stop(
                    trainer,
                    f"{self.monitor} did not improve for {self.patience} checks (best {self.best:.6g})",
                )

    def _stop(self, trainer: Any, reason: str) -> None:
        trainer.should_stop = True
        self.stopped_step, self.reason = trainer.global_step, reason

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait_count": self.wait_count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best, self.wait_count = state_dict["best"], state_dict["wait_count"]
