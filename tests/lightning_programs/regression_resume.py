"""Step-based regression, run three times: uninterrupted, stopped half-way, and resumed from ``last``.

Pins ``max_steps`` with ``accumulate_grad_batches=2``, an int ``val_check_interval`` (it counts
training batches, not optimizer steps), ``limit_val_batches``, value gradient clipping, an AdamW
with two parameter groups under a step-interval scheduler (LearningRateMonitor keys per group),
``ModelCheckpoint(every_n_train_steps=..., save_last=True)`` names, and what resuming restores.
The half-way point is an epoch boundary (12 of 24 steps, 6 steps per epoch), and the training
data is not shuffled, so the resumed run can in principle retrace the uninterrupted one.

Run: ``python regression_resume.py OUTDIR`` (writes OUTDIR/{full,half}/ and OUTDIR/observed.json).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from observe import run_summary, write_observed
from torch.utils.data import DataLoader, TensorDataset

SEED = 42
MAX_STEPS = 24
HALF_STEPS = 12


def linear_data(n: int, seed: int) -> TensorDataset:
    """y = x.w + small noise, fixed by a private generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5]]) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class Regressor(L.LightningModule):
    """3-8-1 MLP; records the loss and global_step seen by every training_step call."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.train_calls: list[dict[str, Any]] = []
        self.val_calls: list[dict[str, Any]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.train_calls.append(
            {
                "epoch": self.current_epoch,
                "batch_idx": batch_idx,
                "global_step": self.global_step,
                "loss": loss.item(),
            }
        )
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.val_calls.append({"batch_idx": batch_idx, "global_step": self.global_step, "loss": loss.item()})
        self.log("val_loss", loss)

    def configure_optimizers(self) -> dict[str, Any]:
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in self.named_parameters() if n.endswith("bias")]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
        )
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def run(outdir: Path, max_steps: int, ckpt_dir: Path, ckpt_path: str | None) -> dict[str, Any]:
    """One fit; a fresh module each time, so a resumed run only knows what the checkpoint holds."""
    L.seed_everything(SEED)
    model = Regressor()
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_last=True)
    trainer = L.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=2,
        val_check_interval=4,
        limit_val_batches=3,
        gradient_clip_val=0.5,
        gradient_clip_algorithm="value",
        log_every_n_steps=1,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ckpt, LearningRateMonitor()],
        logger=CSVLogger(save_dir=outdir, name="lightning_logs"),
        default_root_dir=outdir,
    )
    train = DataLoader(linear_data(96, 1), batch_size=8, shuffle=False, num_workers=0)
    val = DataLoader(linear_data(40, 2), batch_size=8, num_workers=0)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt_path)
    return {
        "max_steps": trainer.max_steps,
        "num_training_batches": trainer.num_training_batches,
        "num_val_batches": trainer.num_val_batches,
        "estimated_stepping_batches": trainer.estimated_stepping_batches,
        "train_calls": model.train_calls,
        "val_calls": model.val_calls,
        "hparams": dict(model.hparams),
        **run_summary(trainer, model, outdir.parent),
    }


def main(outdir: str) -> None:
    root = Path(outdir)
    full = run(root / "full", MAX_STEPS, root / "full" / "checkpoints", None)
    half = run(root / "half", HALF_STEPS, root / "half" / "checkpoints", None)
    resumed = run(root / "half", MAX_STEPS, root / "half" / "checkpoints", "last")
    weights_equal = full["final_weights"] == resumed["final_weights"]
    write_observed(
        root, {"full": full, "half": half, "resumed": resumed, "resumed_equals_full": weights_equal}
    )


if __name__ == "__main__":
    main(sys.argv[1])
