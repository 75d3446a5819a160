"""The names a bug report or an example imports, and the step signatures without ``batch_idx``.

Built on Lightning's demo classes (``BoringModel``, ``BoringDataModule``, ``RandomDataset``), the
``utilities`` helpers (``rank_zero_only``, ``rank_zero_info``, ``model_helpers.is_overridden``, an
``imports`` flag), ``lightning.pytorch.core`` and ``cli_lightning_logo``. Pins
``trainer.is_last_batch`` at every training hook (accumulation 2 over 5 batches: the last window
has one batch), ``training_step(self, batch)`` / ``validation_step(self, batch)`` /
``test_step(self, batch)`` / ``predict_step(self, batch)`` (Lightning inspects the signature and
passes no ``batch_idx``), and what fit, test and predict return and log.

Run: ``python boring_surface.py OUTDIR``.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch import cli_lightning_logo
from lightning.pytorch.core import LightningModule
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.imports import _TORCHVISION_AVAILABLE
from lightning.pytorch.utilities.model_helpers import is_overridden
from observe import run_summary, to_jsonable, write_observed
from torch.utils.data import DataLoader


@rank_zero_only
def on_rank_zero(value: int) -> int:
    return value * 2


class LastBatchWatcher(L.Callback):
    def __init__(self) -> None:
        self.seen: list[list[Any]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(["start", trainer.current_epoch, batch_idx, trainer.is_last_batch])

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.seen.append(["end", trainer.current_epoch, batch_idx, trainer.is_last_batch])

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.seen.append(["epoch_end", trainer.current_epoch, None, trainer.is_last_batch])


class NoIndexModel(BoringModel):
    """BoringModel whose steps take no batch_idx and log what they compute."""

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        loss = self.step(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: torch.Tensor) -> None:
        self.log("val_loss", self.step(batch))

    def test_step(self, batch: torch.Tensor) -> None:
        self.log("test_loss", self.step(batch))

    def predict_step(self, batch: torch.Tensor) -> torch.Tensor:
        return self(batch).sum()


def main(outdir: str) -> None:
    cli_lightning_logo()
    L.seed_everything(7)
    rank_zero_info("boring_surface: starting")
    model = NoIndexModel()
    watcher = LastBatchWatcher()
    trainer = L.Trainer(
        max_epochs=2,
        limit_train_batches=5,
        limit_val_batches=3,
        limit_test_batches=4,
        limit_predict_batches=3,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[watcher],
        logger=CSVLogger(save_dir=outdir, name="lightning_logs"),
        default_root_dir=outdir,
    )
    trainer.fit(model, datamodule=BoringDataModule())
    tested = trainer.test(model, datamodule=BoringDataModule(), verbose=False)
    predicted = trainer.predict(model, dataloaders=DataLoader(RandomDataset(32, 8), batch_size=2))
    observed = {
        "is_last_batch": watcher.seen,
        "rank_zero_only_rank": rank_zero_only.rank,
        "rank_zero_only_call": on_rank_zero(21),
        "torchvision_flag_is_bool": isinstance(bool(_TORCHVISION_AVAILABLE), bool),
        "core_is_the_module_class": LightningModule is L.LightningModule,
        "is_overridden": {
            hook: is_overridden(hook, model)
            for hook in ("training_step", "predict_step", "on_fit_start", "configure_optimizers")
        },
        "tested": tested,
        "predicted": to_jsonable(predicted),
        "final_lr": trainer.optimizers[0].param_groups[0]["lr"],
        **run_summary(trainer, model, outdir),
    }
    write_observed(outdir, observed)


if __name__ == "__main__":
    main(sys.argv[1])
