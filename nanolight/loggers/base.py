"""`Logger`: where metrics go. The trainer calls loggers on global rank zero only."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Logger:
    """Base class. ``log_metrics`` may be called several times for one step (trainer metrics,
    then callbacks such as LearningRateMonitor/ThroughputMonitor, then validation); loggers
    merge them into one row/record per step."""

    def __init__(self, save_dir: str | Path | None = None) -> None:
        self._save_dir = str(save_dir) if save_dir is not None else None

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def save_dir(self) -> str | None:
        return self._save_dir

    @property
    def log_dir(self) -> str:
        """Directory this logger writes into (the trainer exposes it as ``trainer.log_dir``)."""
        return self.save_dir or "."

    def set_default_save_dir(self, path: str | Path) -> None:
        """Called by the trainer with ``default_root_dir``; used only if no ``save_dir`` was given."""
        if self._save_dir is None:
            self._save_dir = str(path)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any]) -> None: ...

    def log_text(self, key: str, text: str, step: int) -> None:
        """A text sample (e.g. a greedy completion); loggers without a text view ignore it."""

    def after_save_checkpoint(self, path: str) -> None:
        """A checkpoint directory was written (WandbLogger may upload it)."""

    def save(self) -> None:
        """Flush buffered data to disk."""

    def finalize(self, status: str) -> None:
        """End of the run (``status`` is "success" or "failed"); flushes by default."""
        self.save()
