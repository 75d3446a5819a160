"""Lightning's demo classes (``lightning.pytorch.demos.boring_classes``): the starting point of bug
reports and tests. Same shapes, same random draws in the same order, same losses and optimizer,
so a program built on them logs what it logs under Lightning."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from nanolight.module import NanoDataModule, NanoModule


class RandomDataset(Dataset):
    """`length` vectors of `size` standard-normal values, drawn once at construction."""

    def __init__(self, size: int, length: int) -> None:
        self.len, self.data = length, torch.randn(length, size)

    def __getitem__(self, index: int) -> Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len


class RandomDictDataset(RandomDataset):
    """Items as ``{"a": x, "b": x + 2}``."""

    def __getitem__(self, index: int) -> dict[str, Tensor]:  # type: ignore[override]
        a = self.data[index]
        return {"a": a, "b": a + 2}


class RandomIterableDataset(IterableDataset):
    """`count` fresh random vectors per pass, no length."""

    def __init__(self, size: int, count: int) -> None:
        self.size, self.count = size, count

    def __iter__(self) -> Iterator[Tensor]:
        return (torch.randn(self.size) for _ in range(self.count))


class RandomIterableDatasetWithLen(RandomIterableDataset):
    def __len__(self) -> int:
        return self.count


class BoringModel(NanoModule):
    """Linear(32, 2) pulled towards ones by MSE, SGD(lr=0.1) with StepLR(step_size=1), a
    64-sample random loader for every stage. Subclass it and replace what the report is about."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)

    def loss(self, preds: Tensor, labels: Tensor | None = None) -> Tensor:
        return torch.nn.functional.mse_loss(preds, torch.ones_like(preds) if labels is None else labels)

    def step(self, batch: Any) -> Tensor:
        return self.loss(self(batch))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        return {"loss": self.step(batch)}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        return {"x": self.step(batch)}

    def test_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        return {"y": self.step(batch)}

    def configure_optimizers(self) -> tuple[list[torch.optim.Optimizer], list[Any]]:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))

    def test_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))


class ManualOptimBoringModel(BoringModel):
    """BoringModel stepping its optimizer itself."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:  # type: ignore[override]
        opt = self.optimizers()
        loss = self.step(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


class DemoModel(NanoModule):
    """Linear(32, out_dim) + ReLU whose output sum is the loss, under Adam."""

    def __init__(self, out_dim: int = 10, learning_rate: float = 0.02) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(32, out_dim)
        self.learning_rate = learning_rate

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.l1(x.view(x.size(0), -1)))

    def training_step(self, batch: Any, batch_nb: int) -> Tensor:
        return self(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.learning_rate)


class BoringDataModule(NanoDataModule):
    """256 random vectors drawn at construction, cut into four disjoint 64-sample stage sets."""

    def __init__(self) -> None:
        super().__init__()
        self.random_full = RandomDataset(32, 64 * 4)

    def setup(self, stage: str) -> None:
        part = lambda k: Subset(self.random_full, indices=range(64 * k, 64 * (k + 1)))  # noqa: E731
        if stage == "fit":
            self.random_train = part(0)
        if stage in ("fit", "validate"):
            self.random_val = part(1)
        if stage == "test":
            self.random_test = part(2)
        if stage == "predict":
            self.random_predict = part(3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.random_train)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.random_val)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.random_test)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.random_predict)


class BoringDataModuleNoLen(NanoDataModule):
    """Iterable random stage sets without a length (512 / 128 / 256 / 64 samples)."""

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.random_train = RandomIterableDataset(32, 512)
        if stage in ("fit", "validate"):
            self.random_val = RandomIterableDataset(32, 128)
        if stage == "test":
            self.random_test = RandomIterableDataset(32, 256)
        if stage == "predict":
            self.random_predict = RandomIterableDataset(32, 64)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.random_train)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.random_val)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.random_test)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.random_predict)
