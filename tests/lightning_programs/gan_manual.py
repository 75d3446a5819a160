"""A tiny 2-D GAN under manual optimization: two optimizers, one hand-stepped scheduler.

Pins ``automatic_optimization = False`` with ``self.optimizers()``, ``self.lr_schedulers()``,
``toggle_optimizer``/``untoggle_optimizer``, ``manual_backward``, ``clip_gradients(..., "norm")``,
``global_step`` (one per ``optimizer.step()``, so two per batch here) against the ``step`` column of
metrics.csv, and LearningRateMonitor's names for two optimizers of the same class.

Run: ``python gan_manual.py OUTDIR``.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from observe import run_summary, write_observed
from torch.utils.data import DataLoader, TensorDataset

SEED = 7


def gan_data(n: int, seed: int) -> TensorDataset:
    """Real points around (2, -1) and the generator's noise, both fixed up front, so the run does
    not depend on how a framework consumes the global RNG."""
    g = torch.Generator().manual_seed(seed)
    real = torch.tensor([2.0, -1.0]) + 0.3 * torch.randn(n, 2, generator=g)
    noise = torch.randn(n, 2, generator=g)
    return TensorDataset(real, noise)


class GAN(L.LightningModule):
    """Generator 2-8-2, discriminator 2-8-1; D is stepped first, then G against the updated D."""

    def __init__(self, lr_g: float = 0.01, lr_d: float = 0.02, clip: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        self.discriminator = torch.nn.Sequential(
            torch.nn.Linear(2, 8), torch.nn.LeakyReLU(0.2), torch.nn.Linear(8, 1)
        )
        self.steps_seen: list[dict[str, Any]] = []

    def _bce(self, logits: torch.Tensor, target: float) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        sched_d = self.lr_schedulers()
        seen: dict[str, Any] = {
            "epoch": self.current_epoch,
            "batch_idx": batch_idx,
            "at_start": self.global_step,
        }

        self.toggle_optimizer(opt_d)
        fake = self.generator(noise).detach()
        d_loss = 0.5 * (self._bce(self.discriminator(real), 1.0) + self._bce(self.discriminator(fake), 0.0))
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=self.hparams.clip, gradient_clip_algorithm="norm")
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        seen["after_d_step"] = self.global_step

        self.toggle_optimizer(opt_g)
        g_loss = self._bce(self.discriminator(self.generator(noise)), 1.0)
        self.manual_backward(g_loss)
        self.clip_gradients(opt_g, gradient_clip_val=self.hparams.clip, gradient_clip_algorithm="norm")
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        seen["after_g_step"] = self.global_step

        if (batch_idx + 1) % 2 == 0:
            sched_d.step()
        seen.update(d_loss=d_loss.item(), g_loss=g_loss.item())
        self.steps_seen.append(seen)
        self.log("d_loss", d_loss, prog_bar=True)
        self.log("g_loss", g_loss, on_step=True, on_epoch=True)

    def configure_optimizers(self) -> tuple[list[torch.optim.Optimizer], list[Any]]:
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr_g, betas=(0.5, 0.9))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr_d, betas=(0.5, 0.9))
        sched_d = torch.optim.lr_scheduler.StepLR(opt_d, step_size=1, gamma=0.8)
        return [opt_g, opt_d], [sched_d]


def main(outdir: str) -> None:
    L.seed_everything(SEED)
    model = GAN()
    trainer = L.Trainer(
        max_epochs=3,
        log_every_n_steps=1,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[LearningRateMonitor()],
        logger=CSVLogger(save_dir=outdir, name="lightning_logs"),
        default_root_dir=outdir,
    )
    train = DataLoader(gan_data(64, 3), batch_size=16, shuffle=False, num_workers=0)
    trainer.fit(model, train_dataloaders=train)
    observed = {
        "steps_seen": model.steps_seen,
        "num_training_batches": trainer.num_training_batches,
        "estimated_stepping_batches": trainer.estimated_stepping_batches,
        "hparams": dict(model.hparams),
        **run_summary(trainer, model, outdir),
    }
    write_observed(outdir, observed)


if __name__ == "__main__":
    main(sys.argv[1])
