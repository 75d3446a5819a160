"""`Logger`: where metrics go. The trainer calls loggers on global rank zero only.

Lightning's interface: ``name``, ``version``, ``save_dir``, ``root_dir`` and ``log_dir`` say where
a logger writes (``ModelCheckpoint`` derives its default directory from the first logger's
``save_dir/name/version``), ``log_metrics`` writes one record per call (records are not merged),
``after_save_checkpoint`` receives the `ModelCheckpoint` that just saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Logger:
    """Base class; subclasses override ``log_metrics`` and whichever of the rest they support."""

    def __init__(self, save_dir: str | Path | None = None) -> None:
        self._save_dir = str(save_dir) if save_dir is not None else None

    @property
    def name(self) -> str | None:
        """The experiment's name (a directory level under ``save_dir`` for file loggers)."""
        return type(self).__name__

    @property
    def version(self) -> int | str | None:
        """The run's version: an int reads ``version_<n>``, a str is used as is."""
        return None

    @property
    def save_dir(self) -> str | None:
        return self._save_dir

    @property
    def root_dir(self) -> str | None:
        """The directory holding every version of this experiment (None when not file-based)."""
        return None

    @property
    def log_dir(self) -> str | None:
        """Directory this logger writes into (the trainer exposes it as ``trainer.log_dir``);
        ``save_dir`` for loggers without versioned directories, as Lightning's trainer reads it."""
        return self.save_dir

    def set_default_save_dir(self, path: str | Path) -> None:
        """Called by the trainer with ``default_root_dir``; used only if no ``save_dir`` was given."""
        if self._save_dir is None:
            self._save_dir = str(path)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any], *args: Any, **kwargs: Any) -> None: ...

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """Record the model graph; loggers without a graph view ignore it."""

    def log_text(self, key: str, text: str, step: int) -> None:
        """A text sample (e.g. a greedy completion); loggers without a text view ignore it."""

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """`checkpoint_callback` (a `ModelCheckpoint`) just wrote a checkpoint directory; its
        ``last_checkpoint_saved`` names it (WandbLogger may upload it)."""

    def save(self) -> None:
        """Flush buffered data to disk."""

    def finalize(self, status: str) -> None:
        """End of the run (``status`` is "success" or "failed"); flushes by default."""
        self.save()
