"""The logging page of Lightning's docs, joined into one program: ``self.log`` with ``prog_bar``,
``logger=False``, ``reduce_fx`` (max, sum), ``on_step``/``on_epoch`` in training and validation,
an explicit ``batch_size``, ``self.log_dict``, ``add_dataloader_idx=False`` with two validation
loaders, and a torch scalar vs a Python float. Pins metrics.csv, ``callback_metrics``,
``logged_metrics`` and ``progress_bar_metrics`` after fit and after validate.

Run: ``python logging_page.py OUTDIR``.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from observe import metrics_dict, run_summary, write_observed
from torch.utils.data import DataLoader, TensorDataset


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, :1] - x[:, 1:2] > 0).long().squeeze(1))


class LoggingModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(6, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", acc, on_step=True, on_epoch=True, prog_bar=True, logger=True)
        self.log("hidden", loss * 2, logger=False, prog_bar=True)
        self.log("max_logit", logits.max(), reduce_fx="max", on_step=False, on_epoch=True)
        self.log("seen", float(len(x)), reduce_fx="sum", on_step=False, on_epoch=True)
        self.log_dict({"dict_a": loss + 1, "dict_b": 3.0}, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("val_loss", loss, batch_size=len(x), prog_bar=True)
        self.log(f"val_loss_{dataloader_idx}", loss, add_dataloader_idx=False)
        self.log("val_step_loss", loss, on_step=True, on_epoch=False)

    def on_validation_epoch_end(self) -> None:
        self.log("val_epoch_marker", float(self.current_epoch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


def main(outdir: str) -> None:
    L.seed_everything(21)
    model = LoggingModel()
    trainer = L.Trainer(
        max_epochs=3,
        log_every_n_steps=2,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=CSVLogger(save_dir=outdir, name="lightning_logs"),
        default_root_dir=outdir,
    )
    train = DataLoader(data(50, 1), batch_size=8)  # 7 batches, the last of 2
    vals = [DataLoader(data(20, 2), batch_size=6), DataLoader(data(12, 3), batch_size=5)]
    trainer.fit(model, train, vals)
    after_fit = {
        "callback_metrics": metrics_dict(trainer.callback_metrics),
        "logged_metrics": metrics_dict(trainer.logged_metrics),
        "progress_bar_metrics": metrics_dict(trainer.progress_bar_metrics),
    }
    validated = trainer.validate(model, vals, verbose=False)
    observed = {
        "after_fit": after_fit,
        "validated": validated,
        "progress_bar_metrics": metrics_dict(trainer.progress_bar_metrics),
        **run_summary(trainer, model, outdir),
    }
    write_observed(outdir, observed)


if __name__ == "__main__":
    main(sys.argv[1])
