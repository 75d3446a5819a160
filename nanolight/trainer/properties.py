"""The read-only attributes Lightning users read from a trainer (``trainer.global_step``,
``trainer.callback_metrics``, ``trainer.max_epochs``, ...), mixed into `NanoTrainer`: each
answered by the part that holds it (the strategy, the metric store, the fit loop, the config);
the stage flags read ``trainer.state`` (`states.py`)."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.overrides import is_overridden

from nanolight.callbacks.early_stopping import EarlyStopping
from nanolight.callbacks.model_checkpoint import ModelCheckpoint
from nanolight.callbacks.progress import RichProgressBar
from nanolight.module.module import NanoModule
from nanolight.trainer.arguments import TrainerConfig

if TYPE_CHECKING:
    from nanolight.loggers.base import Logger
    from nanolight.trainer.trainer import NanoTrainer


def _stage_flag(stage: str) -> property:
    def get(self: NanoTrainer) -> bool:
        return self.state.stage == stage

    def set_(self: NanoTrainer, value: bool) -> None:
        if value:
            self.state.stage = stage
        elif self.state.stage == stage:
            self.state.stage = None

    return property(get, set_, doc=f"True while the {stage!r} loop runs.")


def _from(part: str, name: str) -> property:
    """A read-only attribute answered by one of the trainer's parts (``strategy``, ``metrics``)."""
    return property(lambda self: getattr(getattr(self, part), name), doc=f"``trainer.{part}.{name}``")


class TrainerProperties:
    """`NanoTrainer`'s only mixin (see the module docstring)."""

    is_global_zero = _from("strategy", "is_global_zero")
    world_size = _from("strategy", "world_size")
    global_rank = _from("strategy", "global_rank")
    local_rank = _from("strategy", "local_rank")
    optimizers = _from("strategy", "optimizers")
    model = _from("strategy", "module")
    callback_metrics = _from("metrics", "callback_metrics")
    logged_metrics = _from("metrics", "logged_metrics")
    training = _stage_flag("train")
    validating = _stage_flag("validate")
    testing = _stage_flag("test")
    predicting = _stage_flag("predict")
    sanity_checking = _stage_flag("sanity_check")

    @property
    def global_step(self: NanoTrainer) -> int:
        """Optimizer steps taken (Lightning: one per ``optimizer.step()``)."""
        return self.progress["global_step"]

    @property
    def current_epoch(self: NanoTrainer) -> int:
        return self.progress["epoch"]

    @property
    def log_step(self: NanoTrainer) -> int:
        """The ``step`` a logger row gets now: batches that stepped so far (Lightning's counter;
        during optimizer step k, 1-based, it is k - 1, so ``step = global_step - 1`` in a training
        row; in a row written by ``validate()`` after fit it is ``global_step``)."""
        return self.progress["stepped"]

    @property
    def should_log(self: NanoTrainer) -> bool:
        """Whether a step row is due (every ``log_every_n_steps`` steps, and every step once
        ``should_stop`` is set), as Lightning's ``should_update_logs``."""
        n = self.config.log_every_n_steps
        return n > 0 and ((self.log_step + 1) % n == 0 or self.should_stop)

    @property
    def is_last_batch(self: NanoTrainer) -> bool:
        """Lightning's flag: fit is running its epoch's last training batch (stays True through
        that epoch's end hooks)."""
        return self.fit_loop.is_last_batch

    @property
    def logger(self: NanoTrainer) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self: NanoTrainer) -> str:
        """The first logger's directory, as global rank 0 resolved it (a new ``version_N`` is
        picked there once), else the root dir."""
        if self.logger is None:
            return self.default_root_dir
        return self.__dict__.get("_log_dir") or self.logger.log_dir

    @property
    def progress_bar_metrics(self: NanoTrainer) -> dict[str, float]:
        """What ``self.log(..., prog_bar=True)`` showed last, as Python floats (Lightning's). Kept as
        tensors until read: converting reads the device, so only a reader pays that sync."""
        return {k: float(v) for k, v in self.metrics.progress_bar_metrics.items()}

    @property
    def progress_bar_callback(self: NanoTrainer) -> RichProgressBar | None:
        """The progress bar among the callbacks (None when ``enable_progress_bar=False``)."""
        return next((cb for cb in self.callbacks if isinstance(cb, RichProgressBar)), None)

    @property
    def checkpoint_callbacks(self: NanoTrainer) -> list[ModelCheckpoint]:
        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    @property
    def checkpoint_callback(self: NanoTrainer) -> ModelCheckpoint | None:
        cbs = self.checkpoint_callbacks
        return cbs[0] if cbs else None

    @property
    def early_stopping_callbacks(self: NanoTrainer) -> list[EarlyStopping]:
        return [cb for cb in self.callbacks if isinstance(cb, EarlyStopping)]

    @property
    def early_stopping_callback(self: NanoTrainer) -> EarlyStopping | None:
        cbs = self.early_stopping_callbacks
        return cbs[0] if cbs else None

    @property
    def train_dataloader(self: NanoTrainer) -> Any:
        """The loader fit trains on, as processed (under data parallelism with its injected
        DistributedSampler); None until fit asks for it. Lightning's ``trainer.train_dataloader``:
        ported programs read it to inspect the sampler or the dataset."""
        return self.fit_loop.train_loader

    @property
    def precision(self: NanoTrainer) -> str:
        return self.strategy.precision.mode

    @property
    def enable_validation(self: NanoTrainer) -> bool:
        """Fit validates: a validation_step, a validation source and ``limit_val_batches`` > 0."""
        module = self.lightning_module
        return (
            module is not None
            and is_overridden("validation_step", module, NanoModule)
            and self.config.limit_val_batches != 0
            and self.data.has_source("val")
        )

    @property
    def estimated_stepping_batches(self: NanoTrainer) -> int | float:
        """Optimizer steps fit will take (Lightning's estimate; asks for the train loader if needed)."""
        cfg = self.config
        if cfg.max_epochs == -1:
            return math.inf if cfg.max_steps == -1 else cfg.max_steps
        total = self.fit_loop.ensure_train_data()
        if total == math.inf:
            return cfg.max_steps
        steps = math.ceil(total / cfg.accumulate_grad_batches) * max(cfg.max_epochs, 1)
        return min(steps, cfg.max_steps) if cfg.max_steps != -1 else steps

    def __getattr__(self, name: str) -> Any:
        """The loop options by their Lightning names (``trainer.max_epochs``, ...)."""
        config = self.__dict__.get("config")
        if config is not None and name in _CONFIG_NAMES:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


# the loop options read by their Lightning names (Lightning has no ``trainer.max_time``)
_CONFIG_NAMES = frozenset(f.name for f in fields(TrainerConfig)) - {"max_time"}
