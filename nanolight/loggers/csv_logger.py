"""`CSVLogger`: ``<save_dir>/metrics.csv``, one row per logged step.

Rows are merged by step (several ``log_metrics`` calls per step become one row) and written
when a later step arrives or on ``save``. A column that appears later (e.g. ``val/loss`` after
the first validation) makes the file be rewritten with the widened header. When the run
resumes into an existing file, rows at or after the first newly logged step are dropped: they
came from the part of the interrupted run after its last checkpoint.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only

from nanolight.loggers.base import Logger


class CSVLogger(Logger):
    def __init__(self, save_dir: str | Path | None = None, filename: str = "metrics.csv") -> None:
        super().__init__(save_dir)
        self.filename = filename
        self.columns: list[str] = ["step"]
        self.rows: list[dict[str, Any]] = []
        self._pending: dict[str, Any] | None = None
        self._written = 0  # rows already in the file
        self._loaded = False
        self.hparams: dict[str, Any] = {}

    @property
    def path(self) -> Path:
        return Path(self.log_dir) / self.filename

    def _load_existing(self, first_step: int) -> None:
        self._loaded = True
        if not self.path.is_file():
            return
        with open(self.path, newline="") as f:
            reader = csv.DictReader(f)
            self.columns = list(reader.fieldnames or ["step"])
            rows = [{k: v for k, v in r.items() if v != ""} for r in reader]
        self.rows = [r for r in rows if int(r["step"]) < first_step]
        self._written = -1  # force a rewrite: rows may have been dropped

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self._loaded:
            self._load_existing(step)
        if self._pending is not None and self._pending["step"] != step:
            self._flush_pending()
        if self._pending is None:
            self._pending = {"step": step}
        self._pending.update(metrics)

    def _flush_pending(self) -> None:
        row, self._pending = self._pending, None
        if row is None:
            return
        new_cols = [k for k in row if k not in self.columns]
        self.columns.extend(new_cols)
        self.rows.append(row)
        if new_cols or self._written < 0:
            self._rewrite()
        else:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, self.columns).writerow(row)
            self._written += 1

    def _rewrite(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, self.columns)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)
        self._written = len(self.rows)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)

    @rank_zero_only
    def save(self) -> None:
        self._flush_pending()
