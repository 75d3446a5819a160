"""The fit loop (epochs of optimizer steps, with validation when due) and the validation loop.

`FitLoop` owns where training stands inside an epoch, so that a checkpoint can record it and a
resumed run continue from the next unseen micro-batch (`data_position.py` says how, for stateful
loaders and for plain ``DataLoader``s); the trainer owns the counters (``trainer.progress``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from nanolight.module.optimizers import step_scheduler
from nanolight.seed import restore_rng_state
from nanolight.trainer import data_position as position
from nanolight.trainer.step import run_step

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer


class FitLoop:
    """Runs `fit`'s epochs; `state_dict` / `load_state_dict` are its part of a checkpoint."""

    def __init__(self, trainer: NanoTrainer) -> None:
        self.trainer = trainer
        self.train_loader: Any = None
        self._epoch_start: dict[str, Any] | None = None  # RNG that ordered this epoch's samples
        self._resume: dict[str, Any] | None = None  # loop position read from a checkpoint
        self._resume_rng: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        loader = self.train_loader
        return {
            "batch_idx": self.trainer.progress["batch_idx"],
            "epoch_start": self._epoch_start,
            "loader": loader.state_dict() if position.is_stateful(loader) else None,
        }

    def load_state_dict(self, loop: dict[str, Any] | None, rng: dict[str, Any] | None) -> None:
        """Continue from `loop` at the next epoch start; the RNG states are restored after the skip."""
        self._resume, self._resume_rng = loop, rng

    def run(self, train_loader: Iterable, val_loader: Iterable | None) -> None:
        trainer = self.trainer
        self.train_loader = train_loader
        trainer.call_hook("on_fit_start")
        trainer.lightning_module.train()
        trainer.call_hook("on_train_start")
        while not trainer.done:
            self._epoch(train_loader, val_loader)
        trainer.call_hook("on_train_end")
        trainer.call_hook("on_fit_end")

    def _iterator(self, loader: Iterable) -> Iterator:
        """Iterator for the current epoch, positioned after the batches a checkpoint consumed."""
        trainer = self.trainer
        resume, self._resume = self._resume, None
        stateful = position.is_stateful(loader)
        position.set_epoch(loader, trainer.current_epoch)
        if resume is not None and stateful and resume.get("loader") is not None:
            loader.load_state_dict(resume["loader"])
        if resume is not None:
            position.restore_epoch_start(loader, resume["epoch_start"])
        self._epoch_start = position.capture_epoch_start(loader)
        iterator = iter(loader)
        if resume is not None and not stateful:
            position.skip(iterator, resume["batch_idx"])
        if self._resume_rng is not None:
            restore_rng_state(self._resume_rng)
            self._resume_rng = None
        if resume is None:
            trainer.progress["batch_idx"] = 0
        return iterator

    def _epoch(self, loader: Iterable, val_loader: Iterable | None) -> None:
        trainer, cfg = self.trainer, self.trainer.config
        iterator = self._iterator(loader)
        trainer.call_hook("on_train_epoch_start")
        while not trainer.done:
            batches = position.take(iterator, cfg.accumulate_grad_batches)
            if not batches:
                if trainer.progress["batch_idx"] == 0:
                    raise ValueError(
                        "the train dataloader yielded no batches: check the dataset and batch size"
                    )
                break
            run_step(trainer, batches)
            trainer.preemption.check()
            if (
                val_loader is not None
                and cfg.val_check_interval
                and trainer.global_step % cfg.val_check_interval == 0
            ):
                validation_loop(trainer, val_loader)
        if val_loader is not None and cfg.val_check_interval is None and not trainer.should_stop:
            validation_loop(trainer, val_loader)
        trainer.metrics.stage = "train"
        trainer.log_metrics(trainer.metrics.finish_epoch(trainer.strategy.reduce))
        trainer.call_hook("on_train_epoch_end")
        for sc in trainer.lr_scheduler_configs:
            if sc.interval == "epoch" and (trainer.current_epoch + 1) % sc.frequency == 0:
                step_scheduler(sc, trainer.callback_metrics)
        trainer.progress["epoch"] += 1
        trainer.progress["batch_idx"] = 0


@torch.no_grad()
def validation_loop(trainer: NanoTrainer, loader: Iterable) -> dict[str, torch.Tensor]:
    """One pass over `loader`: validation_step per batch, then the epoch means (logged)."""
    module, strategy, metrics, hook = (
        trainer.lightning_module,
        trainer.strategy,
        trainer.metrics,
        trainer.call_hook,
    )
    limit = trainer.config.val_batches(position.loader_len(loader))
    was_training = module.training
    module.eval()
    metrics.stage = "val"
    try:
        hook("on_validation_start")
        hook("on_validation_epoch_start")
        for idx, batch in enumerate(loader):
            if limit is not None and idx >= limit:
                break
            batch = strategy.batch_to_device(batch)
            hook("on_validation_batch_start", batch, idx)
            with strategy.autocast():
                out = module.validation_step(batch, idx)
            hook("on_validation_batch_end", out, batch, idx)
        hook("on_validation_epoch_end")
        results = metrics.finish_epoch(strategy.reduce)
        trainer.log_metrics(results)
        hook("on_validation_end")
    finally:
        metrics.stage = "train"
        module.train(was_training)
    return results
