"""The promises of Lightning 2.6.6's ``tests_pytorch/loggers/test_csv.py``, as scenarios of ours:
``CSVLogger``'s versions and directories, ``log_metrics`` / ``log_hyperparams``, flushing, and the
rewritten header. One section per promise (see COVERAGE.md); run: ``python csv_logger_program.py OUTDIR``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch.loggers import CSVLogger
from observe import listing, relative, run_sections
from torch.utils.data import DataLoader, TensorDataset


def _lines(path: str | os.PathLike[str]) -> list[str]:
    return Path(path).read_text().splitlines() if os.path.isfile(path) else []


def automatic_versioning(outdir: str) -> dict[str, Any]:
    for d in ("version_0", "version_1", "version_nonumber", "other"):
        os.makedirs(os.path.join(outdir, "exp", d))
    return {"version": CSVLogger(save_dir=outdir, name="exp").version}


def manual_versioning(outdir: str) -> dict[str, Any]:
    for d in ("version_0", "version_1", "version_2"):
        os.makedirs(os.path.join(outdir, "exp", d))
    logger = CSVLogger(save_dir=outdir, name="exp", version=1)
    return {"version": logger.version, "log_dir": relative(logger.log_dir, outdir)}


def manual_version_existing_file(outdir: str) -> dict[str, Any]:
    """A fixed version whose directory already has a metrics.csv (a new run into it)."""
    os.makedirs(os.path.join(outdir, "exp", "version_0"))
    old = os.path.join(outdir, "exp", "version_0", "metrics.csv")
    Path(old).write_text("step,old\n0,1.0\n")
    logger = CSVLogger(save_dir=outdir, name="exp", version=0)
    before = os.path.exists(old)
    logger.experiment  # noqa: B018  (first use opens the directory)
    after = os.path.exists(old)
    shutil.rmtree(os.path.join(outdir, "exp"))  # a known difference (README): kept out of the csv record
    return {"exists_before_use": before, "exists_after_use": after}


def named_version(outdir: str) -> dict[str, Any]:
    os.makedirs(os.path.join(outdir, "exp"))
    logger = CSVLogger(save_dir=outdir, name="exp", version="2020-02-05-162402")
    logger.log_hyperparams({"a": 1, "b": 2})
    return {
        "version": logger.version,
        "exp": listing(os.path.join(outdir, "exp")),
        "files": listing(os.path.join(outdir, "exp", "2020-02-05-162402")),
    }


def no_name(outdir: str) -> dict[str, Any]:
    out = {}
    for i, name in enumerate(["", None]):
        where = os.path.join(outdir, str(i))
        logger = CSVLogger(save_dir=where, name=name)
        logger.log_hyperparams()
        out[str(name)] = {
            "root_dir": relative(logger.root_dir, where),
            "log_dir": relative(logger.log_dir, where),
            "files": listing(os.path.join(where, "version_0")),
        }
    return out


def log_metrics(outdir: str) -> dict[str, Any]:
    out = {}
    for step in (10, None):
        logger = CSVLogger(os.path.join(outdir, str(step)))
        metrics = {"float": 0.3, "int": 1, "FloatTensor": torch.tensor(0.1), "IntTensor": torch.tensor(1)}
        logger.log_metrics(metrics, step)
        logger.save()
        out[str(step)] = _lines(os.path.join(logger.log_dir, "metrics.csv"))
    return out


def log_hyperparams(outdir: str) -> dict[str, Any]:
    logger = CSVLogger(outdir)
    logger.log_hyperparams(
        {
            "float": 0.3,
            "int": 1,
            "string": "abc",
            "bool": True,
            "dict": {"a": {"b": "c"}},
            "list": [1, 2, 3],
            "layer": torch.nn.BatchNorm1d,
        }
    )
    path = os.path.join(logger.log_dir, "hparams.yaml")
    params = yaml.unsafe_load(Path(path).read_text())  # a class is written with its python tag
    os.remove(path)  # the recorder reads every hparams.yaml with safe_load
    return {k: (v if k != "layer" else getattr(v, "__name__", repr(v))) for k, v in sorted(params.items())}


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.layer(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.argmax(dim=1) % 3), batch_size=4)


def fit_csv_logger(outdir: str) -> dict[str, Any]:
    logger = CSVLogger(save_dir=outdir)
    trainer = L.Trainer(
        default_root_dir=outdir,
        max_steps=10,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Classifier(), _loader(24, 0), _loader(8, 1))
    return {"log_dir": relative(logger.log_dir, outdir), "files": listing(logger.log_dir)}


def flush_n_steps(outdir: str) -> dict[str, Any]:
    logger = CSVLogger(outdir, flush_logs_every_n_steps=2)
    metrics = {"float": 0.3, "int": 1}
    path = os.path.join(logger.log_dir, "metrics.csv")
    logger.log_metrics(metrics, step=0)
    after_0 = _lines(path)
    logger.log_metrics(metrics, step=1)
    return {"after_step_0": after_0, "after_step_1": _lines(path)}


def metrics_reset_after_save(outdir: str) -> dict[str, Any]:
    logger = CSVLogger(outdir, flush_logs_every_n_steps=2)
    logger.log_metrics({"test": 1}, step=0)
    pending = len(logger.experiment.metrics)
    logger.log_metrics({"test": 1}, step=1)
    return {"pending_after_0": pending, "pending_after_1": len(logger.experiment.metrics)}


def append_metrics_file(outdir: str) -> dict[str, Any]:
    """Each save appends the new rows to the file written so far."""
    logger = CSVLogger(outdir, name="test", version=0, flush_logs_every_n_steps=1)
    logger.log_metrics({"a": 1, "b": 2})
    logger.log_metrics({"a": 3, "b": 4})
    first = _lines(logger.experiment.metrics_file_path)
    logger.log_metrics({"a": 100, "b": 200})
    return {"after_two": first, "after_three": _lines(logger.experiment.metrics_file_path)}


def append_columns(outdir: str) -> dict[str, Any]:
    logger = CSVLogger(outdir, flush_logs_every_n_steps=1)
    out = []
    for metrics in ({"a": 1, "b": 2}, {"a": 1, "b": 2, "c": 3}, {"a": 1, "c": 3}):
        logger.log_metrics(metrics)
        out.append(_lines(logger.experiment.metrics_file_path))
    return {"files": out}


SECTIONS = [
    automatic_versioning,
    manual_versioning,
    manual_version_existing_file,
    named_version,
    no_name,
    log_metrics,
    log_hyperparams,
    fit_csv_logger,
    flush_n_steps,
    metrics_reset_after_save,
    append_metrics_file,
    append_columns,
]

if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, L.seed_everything)
