"""A ModelCheckpoint subclass that overrides the class attributes Lightning's names are made of
(``CHECKPOINT_JOIN_CHAR``, ``CHECKPOINT_EQUALS_CHAR``, ``FILE_EXTENSION``): the files fit leaves,
with the version counter's ``v1``, and ``format_checkpoint_name`` called directly with and
without a template, a version and a prefix. Names are recorded without their directory.

Run: ``python checkpoint_names.py OUTDIR``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from observe import run_summary, write_observed
from torch.utils.data import DataLoader, TensorDataset

SEED = 11


class UnderscoreCheckpoint(ModelCheckpoint):
    CHECKPOINT_JOIN_CHAR = "_"
    CHECKPOINT_EQUALS_CHAR = "~"
    FILE_EXTENSION = ".pt"


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(16, 1), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(data(8, 2), batch_size=4)


def main(outdir: str) -> None:
    L.seed_everything(SEED)
    model = Regressor()
    by_default = UnderscoreCheckpoint(
        dirpath=os.path.join(outdir, "default"), every_n_train_steps=1, save_top_k=-1
    )
    by_epoch = UnderscoreCheckpoint(
        dirpath=os.path.join(outdir, "by_epoch"), filename="{epoch}", every_n_train_steps=2, save_top_k=-1
    )
    trainer = L.Trainer(
        max_epochs=1,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[by_default, by_epoch],
        logger=False,
        default_root_dir=outdir,
    )
    trainer.fit(model)
    metrics = {"epoch": 3, "step": 7, "val_loss": torch.tensor(0.125)}
    named = UnderscoreCheckpoint(filename="{epoch}-{val_loss:.2f}")
    formatted = {
        "default": by_default.format_checkpoint_name(dict(metrics)),
        "default_v2": by_default.format_checkpoint_name(dict(metrics), ver=2),
        "default_prefix": by_default.format_checkpoint_name(dict(metrics), prefix="pre"),
        "template": named.format_checkpoint_name(dict(metrics)),
        "template_v1_prefix": named.format_checkpoint_name(dict(metrics), ver=1, prefix="pre"),
        "given_filename": named.format_checkpoint_name(dict(metrics), filename="{step}"),
    }
    formatted = {k: os.path.basename(v) for k, v in formatted.items()}
    write_observed(outdir, {"formatted": formatted, **run_summary(trainer, model, outdir)})


if __name__ == "__main__":
    main(sys.argv[1])
