"""A stand-in trainer with exactly the interface the Lightning-style callbacks may use, and drivers
that call their hooks in Lightning's order. Lets the callbacks be pinned against the recorded
Lightning fixtures without the real trainer (the end-to-end comparison lives elsewhere)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_only

from nanolight.checkpoint.atomic import write_last_pointer

rank_zero_only.rank = 0  # what the strategy's setup_environment sets on a single process

FIXTURES = Path(__file__).parent / "fixtures" / "lightning"
sys.path.insert(0, str(Path(__file__).parent / "lightning_programs"))
from observe import read_csv_logs, stem  # noqa: E402  (the fixtures' own reader)

__all__ = ["FIXTURES", "StandInTrainer", "fixture", "read_csv_logs", "stem", "listing"]


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def listing(dirpath: str | Path) -> list[str]:
    return sorted(p.name for p in Path(dirpath).iterdir())


class StandInStrategy:
    root_device = torch.device("cpu")
    world_size, global_rank, is_global_zero = 1, 0, True  # one process: no shared-directory check

    def barrier(self, name: str | None = None) -> None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj


class StandInTrainer:
    """Only the attributes of the agreed trainer interface; `save_checkpoint` writes a directory
    holding the callbacks' state and moves the ``last`` pointer, as NanoTrainer does."""

    def __init__(
        self, root: str | Path, callbacks: list[Any] = (), loggers: list[Any] = (), **kw: Any
    ) -> None:
        self.callbacks, self.loggers = list(callbacks), list(loggers)
        self.default_root_dir = str(root)
        self.global_step = self.current_epoch = self.log_step = 0
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, float] = {}
        self.is_global_zero, self.global_rank, self.world_size = True, 0, 1
        self.strategy = StandInStrategy()
        self.state = SimpleNamespace(fn="fit")
        self.sanity_checking = self.validating = self.should_stop = False
        self.training, self.should_log = True, True
        self.fast_dev_run = 0
        self.max_epochs, self.max_steps = 1000, -1
        self.val_check_interval: float | int = 1.0
        self.check_val_every_n_epoch: int | None = 1
        self.num_val_batches, self.num_training_batches = [3], 6
        self.optimizers: list[Any] = []
        self.lr_scheduler_configs: list[Any] = []
        self.saves: list[str] = []
        for key, value in kw.items():
            setattr(self, key, value)

    @property
    def logger(self) -> Any:
        return self.loggers[0] if self.loggers else None

    def save_checkpoint(self, path: str | Path, weights_only: bool = False, update_last: bool = True) -> None:
        path = Path(path)
        os.makedirs(path, exist_ok=True)
        state = {cb.state_key: cb.state_dict() for cb in self.callbacks}
        torch.save({"callbacks": state, "global_step": self.global_step}, path / "trainer_state.pt")
        if update_last:
            write_last_pointer(path)
        self.saves.append(path.name)

    def restore_callbacks(self, path: str | Path) -> None:
        saved = torch.load(Path(path) / "trainer_state.pt", weights_only=False)
        self.global_step = saved["global_step"]
        for cb in self.callbacks:
            if cb.state_key in saved["callbacks"]:
                cb.load_state_dict(saved["callbacks"][cb.state_key])

    def call(self, hook: str, *args: Any) -> None:
        """A callback hook, in list order (ModelCheckpoint last, as the trainer orders them)."""
        for cb in self.callbacks:
            getattr(cb, hook)(self, None, *args)


def run_epochs(
    trainer: StandInTrainer,
    epochs: int,
    batches: int,
    accumulate: int = 1,
    validate_after: tuple[int, ...] = (),
    val_metrics: Any = None,
) -> None:
    """Drive fit from `trainer`'s current epoch/step: per micro-batch the batch hooks (the
    optimizer step happens on the window's last micro-batch, before on_train_batch_end), a
    validation after each batch count in `validate_after` (metrics from ``val_metrics(epoch, i)``),
    the epoch-end hooks, and stop when `should_stop` (or `max_steps`) says so."""
    for cb in trainer.callbacks:
        cb.setup(trainer, None, "fit")
    trainer.call("on_train_start")
    for _ in range(epochs):
        trainer.log_step = trainer.global_step
        trainer.call("on_train_epoch_start")
        n_val = 0
        for batch_idx in range(batches):
            trainer.log_step = trainer.global_step
            trainer.call("on_train_batch_start", None, batch_idx)
            if (batch_idx + 1) % accumulate == 0:
                trainer.global_step += 1
            trainer.call("on_train_batch_end", None, None, batch_idx)
            if batch_idx + 1 in validate_after:
                trainer.callback_metrics.update(val_metrics(trainer.current_epoch, n_val))
                n_val += 1
                trainer.call("on_validation_end")
            if trainer.global_step == trainer.max_steps:
                break
        trainer.call("on_train_epoch_end")
        trainer.current_epoch += 1
        if trainer.should_stop or trainer.global_step == trainer.max_steps:
            break
    trainer.call("on_train_end")
