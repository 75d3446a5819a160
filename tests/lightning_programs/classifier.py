"""A plain Lightning classifier: DataModule, fit/validate/test/predict, top-k checkpoints, early stop.

Pins epoch-level logging (train on_step+on_epoch, batch-size-weighted validation means over an
uneven last batch), ModelCheckpoint's filename template and top-k selection, ``ckpt_path="best"``,
what ``validate``/``test``/``predict`` return, and which DataModule stages get set up.

Run: ``python classifier.py OUTDIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from observe import final_weights, run_summary, snapshot, stem, write_observed
from torch.utils.data import DataLoader, TensorDataset

SEED = 1234


def blobs(n: int, seed: int) -> TensorDataset:
    """Three overlapping Gaussian blobs in 4-D, so accuracy is below 1 and losses keep moving."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.tensor([[1.0, 0.0, 0.0, 0.5], [0.0, 1.0, 0.0, -0.5], [0.0, 0.0, 1.0, 0.0]])
    y = torch.randint(0, 3, (n,), generator=g)
    x = centers[y] + 0.8 * torch.randn(n, 4, generator=g)
    return TensorDataset(x, y)


class BlobData(L.LightningDataModule):
    """Sizes chosen so validation (70 = 32+32+6) and test (50 = 32+18) end on a short batch."""

    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.prepare_calls = 0
        self.setup_stages: list[str] = []
        self.loaded_states: list[dict[str, Any]] = []

    def prepare_data(self) -> None:
        self.prepare_calls += 1

    def setup(self, stage: str) -> None:
        self.setup_stages.append(stage)
        self.train_set = blobs(192, 1)
        self.val_set = blobs(70, 2)
        self.test_set = blobs(50, 3)
        self.predict_set = TensorDataset(blobs(20, 4).tensors[0])

    def state_dict(self) -> dict[str, Any]:
        return {"setups_before_save": len(self.setup_stages)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded_states.append(dict(state_dict))

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(7)
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, generator=g, num_workers=0
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=0)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size, num_workers=0)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.predict_set, batch_size=8, num_workers=0)


class Classifier(L.LightningModule):
    """A 4-16-3 MLP; counts step calls so the fixture records how often each ran."""

    def __init__(self, hidden: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3)
        )
        self.calls = {"training_step": 0, "validation_step": 0, "test_step": 0, "predict_step": 0}
        self.val_batches: list[tuple[int, float]] = []  # (batch size, val_loss) per validation_step
        self.phase = ""  # set by main() before each trainer call
        self.seen: dict[str, dict[str, Any]] = {}  # trainer flags at the first step of each kind

    def _see(self, step: str) -> None:
        t = self.trainer
        key = f"{self.phase}/{step}" + ("/sanity" if t.sanity_checking else "")
        if key not in self.seen:
            self.seen[key] = {
                "training": t.training,
                "validating": t.validating,
                "testing": t.testing,
                "sanity_checking": t.sanity_checking,
                "device": str(self.device),
                "global_rank": self.global_rank,
                "local_rank": self.local_rank,
                "logger_is_trainer_logger": self.logger is t.logger,
                "n_loggers": len(self.loggers),
            }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _loss_acc(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y), (logits.argmax(-1) == y).float().mean()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.calls["training_step"] += 1
        self._see("training_step")
        loss, acc = self._loss_acc(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("train_acc", acc)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.calls["validation_step"] += 1
        self._see("validation_step")
        loss, acc = self._loss_acc(batch)
        self.val_batches.append((int(batch[0].shape[0]), float(loss)))
        self.log("val_loss", loss)
        self.log("val_acc", acc)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.calls["test_step"] += 1
        self._see("test_step")
        loss, acc = self._loss_acc(batch)
        self.log("test_loss", loss)
        self.log("test_acc", acc)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.calls["predict_step"] += 1
        self._see("predict_step")
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main(outdir: str) -> None:
    L.seed_everything(SEED)
    dm = BlobData()
    model = Classifier()
    ckpt = ModelCheckpoint(monitor="val_loss", filename="{epoch}-{val_loss:.3f}", save_top_k=2)
    early = EarlyStopping(monitor="val_loss", patience=2, min_delta=0.005)
    trainer = L.Trainer(
        max_epochs=30,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ckpt, early, LearningRateMonitor()],
        logger=CSVLogger(save_dir=outdir, name="lightning_logs"),
        default_root_dir=outdir,
    )
    model.phase = "fit"
    trainer.fit(model, datamodule=dm)
    after_fit = {
        **snapshot(trainer),
        "early_stopping": {
            "stopped_epoch": early.stopped_epoch,
            "wait_count": early.wait_count,
            "best_score": float(early.best_score),
        },
        "calls": dict(model.calls),
        "num_training_batches": trainer.num_training_batches,
        "num_val_batches": trainer.num_val_batches,
        "weights": final_weights(model),
        "checkpoint_callback_is_ours": trainer.checkpoint_callback is ckpt,
        "early_stopping_callback_is_ours": trainer.early_stopping_callback is early,
        "lightning_module_is_model": trainer.lightning_module is model,
        "log_dir": Path(trainer.logger.log_dir).relative_to(outdir).as_posix(),
    }
    model.phase = "validate"
    validate_out = trainer.validate(datamodule=dm)
    after_validate = {**snapshot(trainer), "calls": dict(model.calls), "ckpt_path": stem(trainer.ckpt_path)}
    model.phase = "test"
    test_out = trainer.test(datamodule=dm, ckpt_path="best")
    after_test = {**snapshot(trainer), "calls": dict(model.calls), "ckpt_path": stem(trainer.ckpt_path)}
    model.phase = "predict"
    predict_out = trainer.predict(datamodule=dm)
    loaded = Classifier.load_from_checkpoint(ckpt.best_model_path)
    observed = {
        "after_fit": after_fit,
        "validate_returned": validate_out,
        "after_validate": after_validate,
        "test_returned": test_out,
        "after_test": after_test,
        "predict_returned": predict_out,
        "calls": model.calls,
        "trainer_flags_seen": model.seen,
        "val_batches": model.val_batches,
        "setup_stages": dm.setup_stages,
        "prepare_data_calls": dm.prepare_calls,
        "datamodule_loaded_states": dm.loaded_states,
        "hparams": dict(model.hparams),
        "load_from_checkpoint": {
            "hparams": dict(loaded.hparams),
            "equals_final_weights": final_weights(loaded) == final_weights(model),
        },
        **run_summary(trainer, model, outdir),
    }
    write_observed(outdir, observed)


if __name__ == "__main__":
    main(sys.argv[1])
