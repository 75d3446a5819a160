"""Tiny models and data shared by the trainer tests (CPU, fp32)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nanolight.module import NanoModule


def make_data(n: int = 64, dim: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = (x @ torch.randn(dim, 1, generator=g)).squeeze(-1) + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, y)


def make_mlp(dim: int = 8, hidden: int = 16, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))


class MLPModule(NanoModule):
    """2-layer MLP regression; optional scheduler; logs train/loss and val/loss."""

    def __init__(self, dim: int = 8, lr: float = 0.05, scheduler: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.dim, self.lr, self.use_scheduler, self.seed = dim, lr, scheduler, seed
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = make_mlp(self.dim, seed=self.seed)

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.model(x).squeeze(-1), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("val/loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(ds: TensorDataset, batch_size: int, shuffle: bool = False) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle)
