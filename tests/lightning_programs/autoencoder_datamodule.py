"""Lightning's ``examples/pytorch/basics/autoencoder.py`` shape with the DataModule page's hooks.

An encoder/decoder on synthetic 8x8 "images" (no download), ``cli_lightning_logo``, a
``LightningDataModule`` with ``save_hyperparameters``, ``prepare_data``, ``setup(stage)`` with a
seeded ``random_split``, all four dataloaders, the batch-transfer hooks, ``state_dict`` /
``load_state_dict``, ``teardown``; then fit, test and predict through ``datamodule=``, and a resumed
fit from the last checkpoint (the datamodule state comes back). Records the datamodule's calls.

Run: ``python autoencoder_datamodule.py OUTDIR``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch import cli_lightning_logo
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from observe import run_summary, write_observed
from torch.utils.data import DataLoader, TensorDataset, random_split


class SyntheticDigits(L.LightningDataModule):
    def __init__(self, batch_size: int = 16, n: int = 160) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.calls: list[list[Any]] = []
        self.epochs_served = 0

    def prepare_data(self) -> None:
        self.calls.append(["prepare_data"])

    def setup(self, stage: str) -> None:
        self.calls.append(["setup", stage])
        g = torch.Generator().manual_seed(0)
        images = torch.rand(self.hparams.n, 1, 8, 8, generator=g)
        labels = torch.randint(0, 10, (self.hparams.n,), generator=g)
        full = TensorDataset(images, labels)
        self.train_set, self.val_set, self.test_set = random_split(
            full, [112, 32, 16], generator=torch.Generator().manual_seed(42)
        )

    def train_dataloader(self) -> DataLoader:
        self.epochs_served += 1
        # not shuffled: a resumed nanolight run replays the saved epoch-start order of a shuffling
        # loader's generator, where Lightning draws afresh (left out of this program, see its README)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=8)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, labels = batch
        return images * 2 - 1, labels  # to [-1, 1]

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, labels = batch
        return images.flatten(1), labels

    def state_dict(self) -> dict[str, Any]:
        return {"epochs_served": self.epochs_served}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calls.append(["load_state_dict", state_dict])
        self.epochs_served = state_dict["epochs_served"]

    def teardown(self, stage: str) -> None:
        self.calls.append(["teardown", stage])


class LitAutoEncoder(L.LightningModule):
    def __init__(self, hidden_dim: int = 16, learning_rate: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = torch.nn.Sequential(
            torch.nn.Linear(64, hidden_dim), torch.nn.ReLU(), torch.nn.Linear(hidden_dim, 3)
        )
        self.decoder = torch.nn.Sequential(torch.nn.Linear(3, hidden_dim), torch.nn.ReLU(), torch.nn.Linear(hidden_dim, 64))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def _loss(self, batch: Any) -> torch.Tensor:
        x, _ = batch
        return F.mse_loss(self(x), x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self.encoder(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


def main(outdir: str) -> None:
    cli_lightning_logo()
    L.seed_everything(1234)
    dm, model = SyntheticDigits(), LitAutoEncoder()
    common = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False, "enable_model_summary": False,
              "default_root_dir": outdir}  # fmt: skip
    ckpt_dir = os.path.join(outdir, "ckpts")
    trainer = L.Trainer(max_epochs=2, logger=CSVLogger(outdir, name="lightning_logs"),
                        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], **common)  # fmt: skip
    trainer.fit(model, datamodule=dm)
    tested = trainer.test(model, datamodule=dm, verbose=False)
    predicted = trainer.predict(model, datamodule=dm)
    resumed_dm, resumed = SyntheticDigits(), LitAutoEncoder()
    again = L.Trainer(max_epochs=3, logger=CSVLogger(outdir, name="resumed"),
                      callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], **common)  # fmt: skip
    again.fit(resumed, datamodule=resumed_dm, ckpt_path="last")
    observed = {
        "datamodule_calls": dm.calls,
        "resumed_datamodule_calls": resumed_dm.calls,
        "resumed_epochs_served": resumed_dm.epochs_served,
        "tested": tested,
        "predicted_shapes": [list(p.shape) for p in predicted],
        "predicted_first": predicted[0].tolist(),
        "first_fit": run_summary(trainer, model, outdir),
        **run_summary(again, resumed, outdir),
    }
    write_observed(outdir, observed)


if __name__ == "__main__":
    main(sys.argv[1])
