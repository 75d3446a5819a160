"""`CSVLogger`: Lightning 2.6's CSV logger: ``<save_dir>/<name>/<version>/metrics.csv`` + ``hparams.yaml``.

As Lightning: ``version=None`` takes the next free ``version_<n>`` under ``<save_dir>/<name>``
(decided at first use, so every run gets a fresh one; rank zero's choice is the one used, since
only rank zero writes and ``ModelCheckpoint`` broadcasts its directory); an int version reads
``version_<n>``, a str is used as is; ``name=""`` and ``version=""`` drop that level. Every
``log_metrics`` call is one row (never merged), with a ``step`` column; the header is the sorted
union of all keys, and the file is rewritten when a new key appears. Rows are buffered and
written every ``flush_logs_every_n_steps`` steps and on ``save``/``finalize``.

nanolight extension, for runs that continue in a fixed directory (the pretraining recipe logs
to ``CSVLogger(save_dir=root, name="", version="")``): when an explicitly given version's
directory already holds a ``metrics.csv``, it is continued instead of replaced: its rows at or
after the first newly logged step are dropped (they came from the part of an interrupted run
after its last checkpoint), earlier rows are kept. With ``merge_rows=True`` (the recipe's) the
calls of one step become one row, as a reader of the file expects: the trainer's row, a
callback's own rows (``LearningRateMonitor``, ``ThroughputMonitor``, each of which Lightning writes
separately) and the validation row of that step; the newest step's row is written when the next
step's arrives or at ``finalize``.
"""

from __future__ import annotations

import csv
import io
import os
from argparse import Namespace
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning_utilities.core.rank_zero import rank_zero_only, rank_zero_warn

from nanolight.checkpoint.atomic import atomic_write_text
from nanolight.loggers.base import Logger


def _join(*parts: str) -> str:
    return os.path.join(*[p for p in parts if p]) if any(parts) else ""


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


class MetricsFile:
    """The ``metrics.csv`` (and ``hparams.yaml``) of one log directory: Lightning's experiment
    writer. `resume`: continue an existing file (see the module docstring) instead of replacing it."""

    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(self, log_dir: str, resume: bool = False, merge_rows: bool = False) -> None:
        self.log_dir = log_dir
        self.merge_rows = merge_rows
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        self.metrics: list[dict[str, Any]] = []  # rows not written yet
        self.metrics_keys: list[str] = []
        self.hparams: dict[str, Any] = {}
        self._resume = resume and os.path.isfile(self.metrics_file_path)
        if not self._resume and os.path.isfile(self.metrics_file_path):
            os.remove(self.metrics_file_path)  # as Lightning: a reused version starts a new file
        os.makedirs(log_dir, exist_ok=True)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        row = {k: _scalar(v) for k, v in metrics.items()}
        row["step"] = len(self.metrics) if step is None else step
        if self.merge_rows and self.metrics and self.metrics[-1]["step"] == row["step"]:
            self.metrics[-1].update(row)  # the same step: one row (a later value of a key wins)
            return
        self.metrics.append(row)

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        allowed: dict[str, Any] = {}
        for key, value in self.hparams.items():
            value = value.name if isinstance(value, Enum) else value
            try:
                yaml.dump(value)
            except (TypeError, ValueError, yaml.YAMLError):
                rank_zero_warn(
                    f"Skipping '{key}' parameter because it is not possible to safely dump to YAML."
                )
                continue
            allowed[key] = value
        with open(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), "w", newline="") as f:
            yaml.dump(allowed, f)

    def save(self, final: bool = True) -> None:
        """Write the buffered rows (rewriting the file when the header widens); unless `final`,
        a merging file keeps its newest row back (more of its step may come)."""
        held = self.metrics[-1:] if self.merge_rows and not final else []
        self.metrics = self.metrics[: len(self.metrics) - len(held)]
        try:
            self._write()
        finally:
            self.metrics = self.metrics + held  # after a write: the held row alone

    def _write(self) -> None:
        if not self.metrics:
            return
        if self._resume:
            self._continue_existing(first_step=self.metrics[0]["step"])
        new_keys = set().union(*self.metrics) - set(self.metrics_keys)
        self.metrics_keys = sorted({*self.metrics_keys, *new_keys})
        exists = os.path.isfile(self.metrics_file_path)
        if new_keys and exists:
            self._rewrite(self._read_rows())
        with open(self.metrics_file_path, "a" if exists else "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
            if not exists:
                writer.writeheader()
            writer.writerows(self.metrics)
        self.metrics = []

    def _read_rows(self) -> list[dict[str, str]]:
        with open(self.metrics_file_path, newline="") as f:
            return list(csv.DictReader(f))

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self.metrics_keys)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(self.metrics_file_path, text.getvalue())

    def _continue_existing(self, first_step: int) -> None:
        self._resume = False
        with open(self.metrics_file_path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("step") and float(r["step"]) < first_step]
        # the header of the rows kept (a column only the dropped rows had goes with them)
        self.metrics_keys = sorted({k for r in rows for k, v in r.items() if v != ""} | {"step"})
        rows = [{k: v for k, v in r.items() if k in self.metrics_keys} for r in rows]
        self._rewrite(rows)


class CSVLogger(Logger):
    """Args: ``save_dir`` (None: the trainer's ``default_root_dir``), ``name``, ``version``,
    ``prefix`` (prepended to every key with ``-``), ``flush_logs_every_n_steps``; nanolight's
    ``merge_rows`` (see the module docstring)."""

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        save_dir: str | os.PathLike[str] | None = None,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
        merge_rows: bool = False,
    ) -> None:
        super().__init__(os.fspath(save_dir) if save_dir is not None else None)
        self._name = name or ""
        self._version = version
        self._fixed_version = version is not None
        self._prefix = prefix
        self._flush_logs_every_n_steps = flush_logs_every_n_steps
        self._merge_rows = merge_rows
        self._experiment: MetricsFile | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = self._get_next_version()
        return self._version

    @property
    def root_dir(self) -> str:
        return _join(self.save_dir or "", self.name)

    @property
    def log_dir(self) -> str:
        version = self.version if isinstance(self.version, str) else f"version_{self.version}"
        return _join(self.root_dir, version) or "."

    @property
    def path(self) -> Path:
        """The metrics file."""
        return Path(self.log_dir) / MetricsFile.NAME_METRICS_FILE

    @property
    def experiment(self) -> MetricsFile:
        """The writer of this run's files (created, with its directory, at first use)."""
        if self._experiment is None:
            self._experiment = MetricsFile(
                self.log_dir, resume=self._fixed_version, merge_rows=self._merge_rows
            )
        return self._experiment

    def _get_next_version(self) -> int:
        root = Path(self.root_dir or ".")
        if not root.is_dir():
            return 0
        versions = [
            int(d.name.split("_", 1)[1])
            for d in root.iterdir()
            if d.is_dir() and d.name.startswith("version_") and d.name.split("_", 1)[1].isdigit()
        ]
        return max(versions) + 1 if versions else 0

    @rank_zero_only
    def log_hyperparams(
        self, params: dict[str, Any] | Namespace | None = None, *args: Any, **kwargs: Any
    ) -> None:
        params = vars(params) if isinstance(params, Namespace) else dict(params or {})
        self.experiment.log_hparams(params)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self._prefix:
            metrics = {f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}": v for k, v in metrics.items()}
        if step is None:
            step = len(self.experiment.metrics)
        self.experiment.log_metrics(metrics, step)
        if (step + 1) % self._flush_logs_every_n_steps == 0:
            self.save()

    @rank_zero_only
    def save(self) -> None:
        self.experiment.save(final=False)  # as Lightning: the first save creates the log directory

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._experiment is not None:
            self.experiment.save()
