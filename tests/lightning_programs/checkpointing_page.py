"""The checkpointing and early-stopping pages of Lightning's docs, joined into one program.

``ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=2, filename="{epoch}-{val_loss:.2f}",
save_last=True)`` next to an every-epoch one, ``EarlyStopping`` with ``stopping_threshold`` off
and ``check_finite``, ``trainer.save_checkpoint``, ``load_from_checkpoint`` (hparams restored),
``test(ckpt_path="best")`` and ``validate(ckpt_path="last")`` (the save_last checkpoint).

Run: ``python checkpointing_page.py OUTDIR``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from observe import final_weights, run_summary, write_observed
from torch.utils.data import DataLoader, TensorDataset


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return TensorDataset(
        x, torch.tanh(x @ torch.tensor([[1.0], [-2.0], [0.5]])) + 0.2 * torch.randn(n, 1, generator=g)
    )


class Model(L.LightningModule):
    def __init__(self, width: int = 12, lr: float = 0.03) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.5)


def main(outdir: str) -> None:
    L.seed_everything(99)
    model = Model(width=10)
    best = ModelCheckpoint(
        dirpath=os.path.join(outdir, "best"), monitor="val_loss", mode="min", save_top_k=2,
        filename="{epoch}-{val_loss:.2f}", save_last=True,
    )  # fmt: skip
    every = ModelCheckpoint(dirpath=os.path.join(outdir, "every"), every_n_epochs=2, save_top_k=-1)
    early = EarlyStopping(monitor="val_loss", mode="min", patience=2, min_delta=0.002, check_finite=True)
    trainer = L.Trainer(
        max_epochs=12, accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[best, every, early], logger=CSVLogger(outdir, name="lightning_logs"), default_root_dir=outdir,
    )  # fmt: skip
    train, val = DataLoader(data(64, 1), batch_size=16), DataLoader(data(32, 2), batch_size=16)
    trainer.fit(model, train, val)
    manual = os.path.join(outdir, "manual.ckpt")
    trainer.save_checkpoint(manual)
    loaded = Model.load_from_checkpoint(best.best_model_path)
    tested = trainer.test(model, DataLoader(data(16, 3), batch_size=8), ckpt_path="best", verbose=False)
    weights_after_best = final_weights(model)
    validated = trainer.validate(model, val, ckpt_path="last", verbose=False)
    observed = {
        "loaded_hparams": dict(loaded.hparams),
        "loaded_weights": final_weights(loaded),
        "tested": tested,
        "weights_after_test_best": weights_after_best,
        "validated": validated,
        "early_stopping": {
            "stopped_epoch": early.stopped_epoch,
            "wait_count": early.wait_count,
            "best_score": float(early.best_score),
        },  # fmt: skip
        "manual_exists": os.path.exists(manual),
        **run_summary(trainer, model, outdir),
    }
    write_observed(outdir, observed)


if __name__ == "__main__":
    main(sys.argv[1])
