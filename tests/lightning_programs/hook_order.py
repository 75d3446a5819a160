"""Every hook Lightning calls, from the module and from a callback, in one ordered trace.

fit (2 epochs x 4 batches, ``accumulate_grad_batches=2``, validation with the default sanity
check, an epoch-interval StepLR, the default ModelCheckpoint), then ``validate``, ``test`` from the
best checkpoint, and ``predict``. Each entry names who was called (module or callback), the hook,
its batch_idx / stage / dataloader_idx where it has one, and ``global_step`` at that moment.
The module supplies its own ``*_dataloader`` methods, so ``fit(model)`` also pins when Lightning
asks for them.

Run: ``python hook_order.py OUTDIR``.
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

SEED = 99
TRACE: list[dict[str, Any]] = []


def record(who: str, hook: str, trainer: Any = None, **args: Any) -> None:
    """Append one call; ``global_step`` only when a trainer is reachable."""
    entry: dict[str, Any] = {"who": who, "hook": hook, **args}
    if trainer is not None:
        entry["global_step"] = int(trainer.global_step)
    TRACE.append(entry)


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


class TracingCallback(L.Callback):
    """Overrides every Callback hook; each only records itself."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        record("callback", "setup", trainer, stage=stage)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        record("callback", "teardown", trainer, stage=stage)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_fit_start", trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_fit_end", trainer)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_sanity_check_start", trainer)

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_sanity_check_end", trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_train_start", trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_train_end", trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_validation_start", trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_validation_end", trainer)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_test_start", trainer)

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_test_end", trainer)

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_predict_start", trainer)

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_predict_end", trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_train_epoch_start", trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_train_epoch_end", trainer)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_validation_epoch_start", trainer)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_validation_epoch_end", trainer)

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_test_epoch_start", trainer)

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_test_epoch_end", trainer)

    def on_predict_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_predict_epoch_start", trainer)

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_predict_epoch_end", trainer)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        record("callback", "on_train_batch_start", trainer, batch_idx=batch_idx)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        record("callback", "on_train_batch_end", trainer, batch_idx=batch_idx)

    def on_validation_batch_start(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        record(
            "callback",
            "on_validation_batch_start",
            trainer,
            batch_idx=batch_idx,
            dataloader_idx=dataloader_idx,
        )

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        record(
            "callback", "on_validation_batch_end", trainer, batch_idx=batch_idx, dataloader_idx=dataloader_idx
        )

    def on_test_batch_start(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        record("callback", "on_test_batch_start", trainer, batch_idx=batch_idx, dataloader_idx=dataloader_idx)

    def on_test_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        record("callback", "on_test_batch_end", trainer, batch_idx=batch_idx, dataloader_idx=dataloader_idx)

    def on_predict_batch_start(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        record(
            "callback", "on_predict_batch_start", trainer, batch_idx=batch_idx, dataloader_idx=dataloader_idx
        )

    def on_predict_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        record(
            "callback", "on_predict_batch_end", trainer, batch_idx=batch_idx, dataloader_idx=dataloader_idx
        )

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        record("callback", "on_before_backward", trainer)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record("callback", "on_after_backward", trainer)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        record("callback", "on_before_optimizer_step", trainer)

    def on_before_zero_grad(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        record("callback", "on_before_zero_grad", trainer)

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        record("callback", "on_save_checkpoint", trainer)

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        record("callback", "on_load_checkpoint", trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        record("callback", "on_exception", trainer)

    def state_dict(self) -> dict[str, Any]:
        record("callback", "state_dict")
        return {"traced": True}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        record("callback", "load_state_dict")


class TracingModule(L.LightningModule):
    """A 2-4-1 regressor overriding every module hook; each records itself and defers to super()."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))

    def _rec(self, hook: str, **args: Any) -> None:
        try:
            trainer = self.trainer
        except RuntimeError:  # Lightning raises when no trainer is attached
            trainer = None
        record("module", hook, trainer, **args)

    # ---- data hooks ----
    def prepare_data(self) -> None:
        self._rec("prepare_data")

    def setup(self, stage: str) -> None:
        self._rec("setup", stage=stage)

    def teardown(self, stage: str) -> None:
        self._rec("teardown", stage=stage)

    def train_dataloader(self) -> DataLoader:
        self._rec("train_dataloader")
        return DataLoader(data(8, 1), batch_size=2, shuffle=False, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        self._rec("val_dataloader")
        return DataLoader(data(4, 2), batch_size=2, num_workers=0)

    def test_dataloader(self) -> DataLoader:
        self._rec("test_dataloader")
        return DataLoader(data(4, 3), batch_size=2, num_workers=0)

    def predict_dataloader(self) -> DataLoader:
        self._rec("predict_dataloader")
        return DataLoader(data(4, 4), batch_size=2, num_workers=0)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self._rec("on_before_batch_transfer", dataloader_idx=dataloader_idx)
        return super().on_before_batch_transfer(batch, dataloader_idx)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        self._rec("transfer_batch_to_device", dataloader_idx=dataloader_idx)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self._rec("on_after_batch_transfer", dataloader_idx=dataloader_idx)
        return super().on_after_batch_transfer(batch, dataloader_idx)

    # ---- configuration ----
    def configure_callbacks(self) -> list[L.Callback]:
        self._rec("configure_callbacks")
        return []

    def configure_model(self) -> None:
        self._rec("configure_model")

    def configure_optimizers(self) -> dict[str, Any]:
        self._rec("configure_optimizers")
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        return {
            "optimizer": opt,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        }

    # ---- steps ----
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._rec("training_step", batch_idx=batch_idx)
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._rec("validation_step", batch_idx=batch_idx)
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._rec("test_step", batch_idx=batch_idx)
        x, y = batch
        self.log("test_loss", F.mse_loss(self.net(x), y))

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._rec("predict_step", batch_idx=batch_idx)
        return self.net(batch[0])

    # ---- optimization hooks ----
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self._rec("backward")
        super().backward(loss, *args, **kwargs)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self._rec("on_before_backward")

    def on_after_backward(self) -> None:
        self._rec("on_after_backward")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._rec("on_before_optimizer_step")

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        self._rec("configure_gradient_clipping")
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        self._rec("optimizer_step", epoch=epoch, batch_idx=batch_idx)
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self._rec("on_before_zero_grad")

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        self._rec("optimizer_zero_grad", epoch=epoch, batch_idx=batch_idx)
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        self._rec("lr_scheduler_step")
        super().lr_scheduler_step(scheduler, metric)

    # ---- checkpoint hooks ----
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._rec("on_save_checkpoint")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._rec("on_load_checkpoint")

    # ---- loop hooks ----
    def on_fit_start(self) -> None:
        self._rec("on_fit_start")

    def on_fit_end(self) -> None:
        self._rec("on_fit_end")

    def on_train_start(self) -> None:
        self._rec("on_train_start")

    def on_train_end(self) -> None:
        self._rec("on_train_end")

    def on_validation_start(self) -> None:
        self._rec("on_validation_start")

    def on_validation_end(self) -> None:
        self._rec("on_validation_end")

    def on_test_start(self) -> None:
        self._rec("on_test_start")

    def on_test_end(self) -> None:
        self._rec("on_test_end")

    def on_predict_start(self) -> None:
        self._rec("on_predict_start")

    def on_predict_end(self) -> None:
        self._rec("on_predict_end")

    def on_train_epoch_start(self) -> None:
        self._rec("on_train_epoch_start")

    def on_train_epoch_end(self) -> None:
        self._rec("on_train_epoch_end")

    def on_validation_epoch_start(self) -> None:
        self._rec("on_validation_epoch_start")

    def on_validation_epoch_end(self) -> None:
        self._rec("on_validation_epoch_end")

    def on_test_epoch_start(self) -> None:
        self._rec("on_test_epoch_start")

    def on_test_epoch_end(self) -> None:
        self._rec("on_test_epoch_end")

    def on_predict_epoch_start(self) -> None:
        self._rec("on_predict_epoch_start")

    def on_predict_epoch_end(self) -> None:
        self._rec("on_predict_epoch_end")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._rec("on_train_batch_start", batch_idx=batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._rec("on_train_batch_end", batch_idx=batch_idx)

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._rec("on_validation_batch_start", batch_idx=batch_idx, dataloader_idx=dataloader_idx)

    def on_validation_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._rec("on_validation_batch_end", batch_idx=batch_idx, dataloader_idx=dataloader_idx)

    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._rec("on_test_batch_start", batch_idx=batch_idx, dataloader_idx=dataloader_idx)

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._rec("on_test_batch_end", batch_idx=batch_idx, dataloader_idx=dataloader_idx)

    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._rec("on_predict_batch_start", batch_idx=batch_idx, dataloader_idx=dataloader_idx)

    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._rec("on_predict_batch_end", batch_idx=batch_idx, dataloader_idx=dataloader_idx)

    def on_validation_model_zero_grad(self) -> None:
        self._rec("on_validation_model_zero_grad")
        super().on_validation_model_zero_grad()

    def on_validation_model_eval(self) -> None:
        self._rec("on_validation_model_eval")
        super().on_validation_model_eval()

    def on_validation_model_train(self) -> None:
        self._rec("on_validation_model_train")
        super().on_validation_model_train()

    def on_test_model_eval(self) -> None:
        self._rec("on_test_model_eval")
        super().on_test_model_eval()

    def on_test_model_train(self) -> None:
        self._rec("on_test_model_train")
        super().on_test_model_train()

    def on_predict_model_eval(self) -> None:
        self._rec("on_predict_model_eval")
        super().on_predict_model_eval()


def main(outdir: str) -> None:
    L.seed_everything(SEED)
    model = TracingModule()
    trainer = L.Trainer(
        max_epochs=2,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TracingCallback()],
        logger=CSVLogger(save_dir=outdir, name="lightning_logs"),
        default_root_dir=outdir,
    )
    results: dict[str, Any] = {}
    record("program", "fit")
    trainer.fit(model)
    record("program", "validate")
    results["validate_returned"] = trainer.validate(model)
    record("program", "test")
    results["test_returned"] = trainer.test(model, ckpt_path="best")
    record("program", "predict")
    results["predict_returned"] = trainer.predict(model)
    record("program", "done")
    write_observed(outdir, {"trace": TRACE, **results, **run_summary(trainer, model, outdir)})


if __name__ == "__main__":
    main(sys.argv[1])
