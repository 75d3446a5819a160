"""The manual-optimization page of Lightning's docs as a program: ``configure_optimizers`` returns a
bare ``ReduceLROnPlateau`` (no ``monitor``: under manual optimization the program steps it), the
module steps it at each epoch end with a metric it logged, and zeroes / steps its optimizer itself.

Run: ``python manual_plateau.py OUTDIR``.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from observe import run_summary, write_observed
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss, on_step=True, on_epoch=True)

    def on_train_epoch_end(self) -> None:
        sch = self.lr_schedulers()
        if isinstance(sch, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sch.step(self.trainer.callback_metrics["train_loss"])
        self.lrs.append(self.optimizers().param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.8)
        return [opt], [plateau]


def main(outdir: str) -> None:
    L.seed_everything(5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 3, generator=g)
    y = x @ torch.tensor([[0.5], [-1.0], [2.0]]) + 0.1 * torch.randn(48, 1, generator=g)
    model = Regressor()
    trainer = L.Trainer(
        max_epochs=4,
        log_every_n_steps=2,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=CSVLogger(save_dir=outdir, name="lightning_logs"),
        default_root_dir=outdir,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    observed = {"lrs": model.lrs, **run_summary(trainer, model, outdir)}
    write_observed(outdir, observed)


if __name__ == "__main__":
    main(sys.argv[1])
