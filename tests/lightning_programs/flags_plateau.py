"""Trainer flags and ReduceLROnPlateau: what runs when, what is logged where.

Pins ``min_epochs``/``min_steps`` holding off an EarlyStopping that asks to stop early,
``limit_train_batches``/``limit_val_batches``, the sanity check (``trainer.sanity_checking``, its
metrics not logged), ``check_val_every_n_epoch=2`` with a float ``val_check_interval``, norm
clipping, a monitored ReduceLROnPlateau, LearningRateMonitor per epoch with momentum, ``self.log``
from the module's and a callback's epoch-end hooks, the ``callback_metrics`` a callback sees in
``on_validation_epoch_end``, a ``training_step`` that returns None, and the trainer's batch counts.

Value clipping lives in regression_resume.py instead: Lightning 2.6.6 on torch 2.13 raises inside
``clip_grad_value_`` on a batch whose ``training_step`` returned None (no gradients to clip).

Run: ``python flags_plateau.py OUTDIR``.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from observe import metrics_dict, run_summary, write_observed
from torch.utils.data import DataLoader, TensorDataset

SEED = 2024


def sine_data(n: int, seed: int) -> TensorDataset:
    """y = sin(2x) + noise on 1-D inputs: a small MLP needs several epochs, so losses keep moving."""
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.rand(n, 1, generator=g) - 1
    return TensorDataset(x, torch.sin(2 * x) + 0.05 * torch.randn(n, 1, generator=g))


class Watcher(L.Callback):
    """Logs from the callback's epoch-end hooks and records what it sees at validation end."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.log("cb_train_epoch_end", float(trainer.current_epoch))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen.append(
            {
                "sanity_checking": trainer.sanity_checking,
                "epoch": trainer.current_epoch,
                "global_step": trainer.global_step,
                "callback_metrics": metrics_dict(trainer.callback_metrics),
            }
        )
        if not trainer.sanity_checking:
            pl_module.log("cb_val_epoch_end", float(trainer.global_step))


class SineFit(L.LightningModule):
    """1-16-1 MLP under SGD with momentum; every 4th training batch (batch_idx 3) is skipped."""

    def __init__(self, lr: float = 0.2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.val_sanity_flags: list[bool] = []
        self.train_calls: list[dict[str, Any]] = []
        self.optimizer_steps = 0
        self.at_train_start: dict[str, Any] = {}

    def on_train_start(self) -> None:
        t = self.trainer
        self.at_train_start = {
            "callback_metrics": metrics_dict(t.callback_metrics),
            "logged_metrics": metrics_dict(t.logged_metrics),
            "estimated_stepping_batches": t.estimated_stepping_batches,
            "num_training_batches": t.num_training_batches,
            "num_val_batches": t.num_val_batches,
            "max_epochs": t.max_epochs,
        }

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        call: dict[str, Any] = {
            "epoch": self.current_epoch,
            "batch_idx": batch_idx,
            "global_step": self.global_step,
        }
        self.train_calls.append(call)
        if batch_idx == 3:
            call["loss"] = None
            return None
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        call["loss"] = loss.item()
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer_steps += 1

    def on_train_epoch_end(self) -> None:
        self.log("module_train_epoch_end", float(self.current_epoch))

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.val_sanity_flags.append(self.trainer.sanity_checking)
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> dict[str, Any]:
        opt = self.sgd = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, mode="min", factor=0.5, patience=0, threshold=0.9
        )
        # frequency=2: stepped only after the epochs that validate (check_val_every_n_epoch=2).
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss", "frequency": 2}}


def main(outdir: str) -> None:
    L.seed_everything(SEED)
    model = SineFit()
    watcher = Watcher()
    early = EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)
    trainer = L.Trainer(
        max_epochs=8,
        min_epochs=3,
        min_steps=46,
        limit_train_batches=8,
        limit_val_batches=0.5,
        num_sanity_val_steps=2,
        check_val_every_n_epoch=2,
        val_check_interval=0.5,
        gradient_clip_val=0.5,
        gradient_clip_algorithm="norm",
        log_every_n_steps=3,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[watcher, early, LearningRateMonitor(logging_interval="epoch", log_momentum=True)],
        logger=CSVLogger(save_dir=outdir, name="lightning_logs"),
        default_root_dir=outdir,
    )
    g = torch.Generator().manual_seed(11)
    train = DataLoader(sine_data(160, 1), batch_size=16, shuffle=True, generator=g, num_workers=0)
    val = DataLoader(sine_data(60, 2), batch_size=8, num_workers=0)  # 8 batches, the last of 4
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    observed = {
        "at_train_start": model.at_train_start,
        "estimated_stepping_batches": trainer.estimated_stepping_batches,
        "num_training_batches": trainer.num_training_batches,
        "num_val_batches": trainer.num_val_batches,
        "max_epochs": trainer.max_epochs,
        "should_stop": trainer.should_stop,
        "val_sanity_flags": model.val_sanity_flags,
        "train_calls": model.train_calls,
        "optimizer_steps": model.optimizer_steps,
        "callback_saw_at_validation_epoch_end": watcher.seen,
        "early_stopping": {"stopped_epoch": early.stopped_epoch, "wait_count": early.wait_count},
        "final_lr": model.sgd.param_groups[0]["lr"],
        **run_summary(trainer, model, outdir),
    }
    write_observed(outdir, observed)


if __name__ == "__main__":
    main(sys.argv[1])
