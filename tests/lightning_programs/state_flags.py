"""``trainer.training / validating / testing / predicting / sanity_checking`` and ``trainer.state``
as every hook sees them, over fit (sanity check, training, validation, a checkpoint save),
``validate``, ``test`` from the best checkpoint, and ``predict``.

A callback overriding every Callback hook and a module overriding its steps and
``configure_optimizers`` each record, per call, the hook, the five flags and ``trainer.state``'s
``fn`` and ``stage`` (Lightning's enums by value).

Run: ``python state_flags.py OUTDIR``.
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

SEED = 5
TRACE: list[dict[str, Any]] = []
FLAGS = ("training", "validating", "testing", "predicting", "sanity_checking")
CALLBACK_HOOKS = (
    "setup",
    "on_fit_start",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_train_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_test_start",
    "on_test_epoch_start",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_test_epoch_end",
    "on_test_end",
    "on_predict_start",
    "on_predict_epoch_start",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_predict_epoch_end",
    "on_predict_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_fit_end",
    "teardown",
)


def record(who: str, hook: str, trainer: Any) -> None:
    """One call: who, the hook, the five flags and the state's fn and stage."""
    state = trainer.state
    entry: dict[str, Any] = {"who": who, "hook": hook, **{f: bool(getattr(trainer, f)) for f in FLAGS}}
    entry["fn"] = getattr(state.fn, "value", state.fn)
    entry["stage"] = getattr(state.stage, "value", state.stage)
    TRACE.append(entry)


def callback_hook(hook: str) -> Any:
    def method(self: L.Callback, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        record("callback", hook, trainer)

    method.__name__ = hook
    return method


FlagCallback = type("FlagCallback", (L.Callback,), {hook: callback_hook(hook) for hook in CALLBACK_HOOKS})


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


class FlagModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        record("module", "training_step", self.trainer)
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        record("module", "validation_step", self.trainer)
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        record("module", "test_step", self.trainer)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        record("module", "predict_step", self.trainer)
        return self.layer(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        record("module", "configure_optimizers", self.trainer)
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(8, 1), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(data(8, 2), batch_size=4)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(data(4, 3), batch_size=4)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(data(4, 4), batch_size=4)


def main(outdir: str) -> None:
    L.seed_everything(SEED)
    model = FlagModule()
    trainer = L.Trainer(
        max_epochs=1,
        num_sanity_val_steps=1,
        log_every_n_steps=1,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[FlagCallback()],
        logger=CSVLogger(save_dir=outdir, name="lightning_logs"),
        default_root_dir=outdir,
    )
    calls: dict[str, Any] = {}
    for name, call in (
        ("fit", lambda: trainer.fit(model)),
        ("validate", lambda: trainer.validate(model, verbose=False)),
        ("test", lambda: trainer.test(model, ckpt_path="best", verbose=False)),
        ("predict", lambda: trainer.predict(model)),
    ):
        TRACE.append({"who": "program", "hook": name})
        call()
        calls[name] = {f: bool(getattr(trainer, f)) for f in FLAGS}  # after the call returned
    write_observed(outdir, {"trace": TRACE, "flags_after": calls, **run_summary(trainer, model, outdir)})


if __name__ == "__main__":
    main(sys.argv[1])
