"""Observables that once differed without an error, pinned against Lightning.

- ``validate`` / ``test`` / ``predict(ckpt_path="last")`` with a ModelCheckpoint that has no
  ``save_last``: Lightning warns and runs the weights in memory.
- A metric one callback logs in ``on_validation_epoch_end`` is in ``callback_metrics`` for the
  callbacks after it, in the same hook.
- With two validation loaders, what the sanity check logged (``*/dataloader_idx_N``) does not
  stay in ``callback_metrics``.
- ``trainer.should_stop`` after an EarlyStopping-ended ``fit``, read during a later ``test``.
- Every ``module.zero_grad()`` call (at the start of each trainer call, ...).
- Separate trainers in one directory each get their own ``lightning_logs/version_N``.

Run: ``python silent_diffs.py OUTDIR``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from observe import metrics_dict, run_summary, write_observed
from torch.utils.data import DataLoader, TensorDataset


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g))


class First(L.Callback):
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            pl_module.log("from_first", float(trainer.global_step))


class Second(L.Callback):
    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.seen.append(sorted(trainer.callback_metrics))


class StopWatch(L.Callback):
    def __init__(self) -> None:
        self.seen: list[list[Any]] = []

    def on_test_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.seen.append(["on_test_start", trainer.should_stop])

    def on_fit_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.seen.append(["on_fit_end", trainer.should_stop])

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.seen.append(["on_train_start", sorted(trainer.callback_metrics)])


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.zero_grads: list[list[Any]] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        trainer = self._trainer
        where = None if trainer is None else [trainer.state.fn, trainer.global_step, trainer.sanity_checking]
        self.zero_grads.append(where)
        super().zero_grad(set_to_none)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self.layer(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(outdir: str) -> None:
    L.seed_everything(11)
    model = Net()
    second, watch = Second(), StopWatch()
    ckpt = ModelCheckpoint(
        dirpath=os.path.join(outdir, "ckpts"), monitor="val_loss/dataloader_idx_0", mode="max", save_top_k=1
    )
    early = EarlyStopping(monitor="val_loss/dataloader_idx_0", patience=0, min_delta=100.0)
    common = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = L.Trainer(
        max_epochs=6,
        limit_train_batches=3,
        num_sanity_val_steps=1,
        callbacks=[First(), second, watch, ckpt, early],
        default_root_dir=outdir,
        **common,
    )
    train = DataLoader(data(24, 1), batch_size=8)
    vals = [DataLoader(data(8, 2), batch_size=4), DataLoader(data(8, 3), batch_size=4)]
    trainer.fit(model, train, vals)
    after_fit = {
        "should_stop": trainer.should_stop,
        "callback_metrics": metrics_dict(trainer.callback_metrics),
    }
    weights_in_memory = [p.detach().clone() for p in model.parameters()]
    last_val = trainer.validate(model, vals[0], ckpt_path="last", verbose=False)
    last_test = trainer.test(model, DataLoader(data(8, 4), batch_size=4), ckpt_path="last", verbose=False)
    last_pred = trainer.predict(model, DataLoader(data(4, 5), batch_size=2), ckpt_path="last")
    same_weights = all(torch.equal(a, b) for a, b in zip(weights_in_memory, model.parameters(), strict=True))
    log_dirs = []
    for call in ("validate", "test", "predict"):
        other = L.Trainer(default_root_dir=outdir, **common)
        loader = DataLoader(data(8, 6), batch_size=4)
        getattr(other, call)(model, loader, **({} if call == "predict" else {"verbose": False}))
        log_dirs.append(os.path.relpath(other.log_dir, outdir) if other.log_dir else None)
    observed = {
        "after_fit": after_fit,
        "second_saw": second.seen,
        "stop_watch": watch.seen,
        "zero_grads": model.zero_grads,
        "last_val": last_val,
        "last_test": last_test,
        "last_pred": [float(p) for p in last_pred],
        "weights_unchanged_by_last": same_weights,
        "log_dirs": [d.replace(os.sep, "/") for d in log_dirs],
        "lightning_logs": sorted(os.listdir(os.path.join(outdir, "lightning_logs"))),
        **run_summary(trainer, model, outdir),
    }
    write_observed(outdir, observed)


if __name__ == "__main__":
    main(sys.argv[1])
