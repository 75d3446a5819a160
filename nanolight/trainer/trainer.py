"""`NanoTrainer`: the training loop. It owns callbacks, loggers and a strategy, and asks the
strategy every question whose answer depends on the parallel layout (it has no parallel code).

Its parts, each with its own state: `loops.FitLoop` (epochs, validation when due, the data
position), `step.run_step` (one optimizer step over the strategy's micro-batch schedule),
`metrics.MetricStore` (what ``self.log`` records), `state` (the trainer's part of a checkpoint)
and `preemption.Preemption` (SIGTERM/SIGUSR1). Hook order follows Lightning's documented
pseudocode: callbacks first, then the module.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.overrides import is_overridden
from lightning_utilities.core.rank_zero import rank_zero_info

from nanolight.callbacks.base import Callback
from nanolight.callbacks.model_checkpoint import ModelCheckpoint
from nanolight.callbacks.progress import RichProgressBar
from nanolight.checkpoint.atomic import LAST_POINTER, resolve_checkpoint, write_last_pointer
from nanolight.checkpoint.files import CheckpointError, with_hint
from nanolight.loggers.base import Logger
from nanolight.loggers.csv_logger import CSVLogger
from nanolight.module import NanoModule
from nanolight.module.optimizers import SchedulerConfig, parse_optimizers
from nanolight.precision import Precision
from nanolight.seed import seed_everything
from nanolight.strategies.base import Strategy
from nanolight.strategies.single_device import SingleDeviceStrategy
from nanolight.trainer.config import TrainerConfig
from nanolight.trainer.loops import FitLoop, validation_loop
from nanolight.trainer.metrics import MetricStore
from nanolight.trainer.preemption import Preemption
from nanolight.trainer.state import build_state, resolve_ckpt_path, restore_state, restore_training_state


class NanoTrainer:
    """Lightning-style trainer. See `TrainerConfig` for the loop options."""

    def __init__(
        self,
        *,
        max_steps: int = -1,
        max_epochs: int | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        precision: str | None = None,
        val_check_interval: int | None = None,
        limit_val_batches: int | float = 1.0,
        log_every_n_steps: int = 50,
        callbacks: list[Callback] | Callback | None = None,
        logger: bool | Logger | list[Logger] = True,
        strategy: str | Strategy | None = None,
        default_root_dir: str | Path | None = None,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        seed: int | None = None,
        deterministic: bool = False,
        fast_dev_run: int | bool = False,
    ) -> None:
        self.config = TrainerConfig(
            max_steps, max_epochs, accumulate_grad_batches, gradient_clip_val, val_check_interval,
            limit_val_batches, log_every_n_steps, fast_dev_run, seed, deterministic,
        )  # fmt: skip
        self.default_root_dir = str(default_root_dir or os.getcwd())
        if strategy in (None, "auto"):
            strategy = SingleDeviceStrategy()
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be None, 'auto' or a Strategy instance, got {strategy!r}")
        if precision is not None:
            strategy.precision = Precision(precision)
        self.strategy = strategy
        fast = bool(self.config.fast_dev_run)
        self.callbacks = _build_callbacks(callbacks, enable_checkpointing, enable_progress_bar, fast)
        self.loggers = _build_loggers(logger, self.default_root_dir, fast)
        self.progress = {"global_step": 0, "epoch": 0, "batch_idx": 0, "samples": 0, "tokens": 0}
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self.lightning_module: NanoModule | None = None
        self.should_stop = False
        self.preempted_by: str | None = None  # "SIGTERM"/"SIGUSR1" if a signal stopped the fit
        self.preemption = Preemption(self)
        self.skip_optimizer_step = False  # set by a callback (NaNGuard) in on_before_optimizer_step
        self.step_loss: torch.Tensor | None = None  # this step's mean loss, the same on every rank
        self.grad_norm: torch.Tensor | None = None
        self.logged_metrics: dict[str, float] = {}
        self.metrics = MetricStore()  # what `NanoModule.log` records
        self.fit_loop = FitLoop(self)
        self._hooks: dict[str, list[tuple[Any, bool]]] = {}

    # ---- properties --------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        return self.progress["global_step"]

    @property
    def current_epoch(self) -> int:
        return self.progress["epoch"]

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        return self.metrics.callback_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, torch.Tensor]:
        return self.metrics.progress_bar_metrics

    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str:
        return self.logger.log_dir if self.logger is not None else self.default_root_dir

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    @property
    def max_steps(self) -> int:
        return self.config.max_steps

    @property
    def should_log(self) -> bool:
        """Whether this optimizer step's metrics go to the loggers (every ``log_every_n_steps``)."""
        return self.global_step % self.config.log_every_n_steps == 0

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.strategy.optimizers

    @property
    def done(self) -> bool:
        """Training stops: asked to, or ``max_steps`` / ``max_epochs`` reached."""
        cfg = self.config
        return (
            self.should_stop
            or (cfg.max_steps >= 0 and self.global_step >= cfg.max_steps)
            or (cfg.max_epochs is not None and self.current_epoch >= cfg.max_epochs)
        )

    # ---- hooks & logging ---------------------------------------------------------------
    def call_hook(self, name: str, *args: Any) -> None:
        """Callbacks (in order) then the module, as Lightning does; only overridden hooks are
        called (resolved once per run: a step fires ~10 hooks per micro-batch)."""
        targets = self._hooks.get(name)
        if targets is None:
            module = self.lightning_module
            targets = [
                (getattr(cb, name), True) for cb in self.callbacks if is_overridden(name, cb, Callback)
            ]
            if is_overridden(name, module, NanoModule):
                targets.append((getattr(module, name), False))
            self._hooks[name] = targets
        for fn, is_callback in targets:
            if is_callback:
                fn(self, self.lightning_module, *args)
            else:
                fn(*args)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Send metrics (floats or scalar tensors) to every logger (rank zero only); callbacks use this too."""
        if not metrics:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        self.logged_metrics.update(metrics)
        if self.is_global_zero:
            for lg in self.loggers:
                lg.log_metrics(dict(metrics), self.global_step if step is None else step)

    # ---- entry points ------------------------------------------------------------------
    def fit(
        self,
        module: NanoModule,
        train_dataloaders: Iterable,
        val_dataloaders: Iterable | None = None,
        ckpt_path: str | Path | None = None,
    ) -> None:
        with self.preemption:  # SIGTERM/SIGUSR1: finish the step, save, stop (preemption.py)
            self._run("fit", module, ckpt_path, lambda: self.fit_loop.run(train_dataloaders, val_dataloaders))

    def validate(
        self, module: NanoModule, dataloaders: Iterable, ckpt_path: str | Path | None = None
    ) -> dict:
        """Run one validation epoch; returns its epoch metrics."""
        result: dict[str, Any] = {}
        self._run("validate", module, ckpt_path, lambda: result.update(validation_loop(self, dataloaders)))
        return {k: float(v) for k, v in result.items()}

    def _run(self, stage: str, module: NanoModule, ckpt_path: Any, loop: Any) -> None:
        if not isinstance(module, NanoModule):
            raise TypeError(f"expected a NanoModule, got {type(module).__name__}")
        self.lightning_module, module.trainer = module, self
        self._hooks = {}
        self.should_stop = False
        was_deterministic = torch.are_deterministic_algorithms_enabled()
        try:
            self._setup(stage, module, ckpt_path)
            loop()
            for lg in self.loggers if self.is_global_zero else []:
                lg.finalize("success")
            self.call_hook("teardown", stage)
        except BaseException as exc:
            self.call_hook("on_exception", exc)
            for lg in self.loggers if self.is_global_zero else []:
                lg.finalize("failed")
            raise
        finally:
            self.strategy.teardown()
            torch.use_deterministic_algorithms(was_deterministic)  # process-global: restore it

    def _setup(self, stage: str, module: NanoModule, ckpt_path: Any) -> None:
        cfg = self.config
        self.strategy.setup_environment()
        if cfg.seed is not None:
            seed_everything(cfg.seed)
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        self.call_hook("setup", stage)
        with self.strategy.model_init_context():
            module.configure_model()
        self.strategy.setup_module(module)
        if stage == "fit":
            optimizers, self.lr_scheduler_configs = parse_optimizers(module.configure_optimizers())
            self.strategy.setup_optimizers(optimizers)
        path = resolve_ckpt_path(self, ckpt_path)
        if path is not None:
            rank_zero_info(f"Restoring from checkpoint {path}")
            state = restore_state(self, path)
            if stage == "fit":
                restore_training_state(self, path, state)
        if stage == "fit" and self.is_global_zero:
            for lg in self.loggers:
                lg.log_hyperparams(dict(getattr(module, "hparams", {}) or {}))

    # ---- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path, update_last: bool = True) -> None:
        """Save a full training checkpoint to directory ``path`` (all ranks must call this)."""
        path = Path(path)
        try:
            self.strategy.save_checkpoint(path, build_state(self))
        except CheckpointError as exc:  # e.g. a full disk: the save's temporary directory is gone
            last = resolve_checkpoint(path.parent / LAST_POINTER)
            where = f"`last` still points at {last.name}" if last else "there is no earlier checkpoint"
            raise with_hint(exc, f"nothing of {path.name} was published, {where}") from exc
        if update_last and self.is_global_zero:
            write_last_pointer(path)
        self.strategy.barrier("last_pointer")


def _build_callbacks(
    callbacks: Any, checkpointing: bool, progress_bar: bool, fast_dev_run: bool
) -> list[Callback]:
    """User callbacks + defaults (ModelCheckpoint, progress bar); checkpointing moved last so it
    saves what every other callback did this step (as Lightning does). ``fast_dev_run`` drops
    checkpointing."""
    cbs = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
    if fast_dev_run:
        cbs = [cb for cb in cbs if not isinstance(cb, ModelCheckpoint)]
    elif checkpointing and not any(isinstance(cb, ModelCheckpoint) for cb in cbs):
        cbs.append(ModelCheckpoint())
    if progress_bar and not any(isinstance(cb, RichProgressBar) for cb in cbs):
        cbs.append(RichProgressBar())
    return [cb for cb in cbs if not isinstance(cb, ModelCheckpoint)] + [
        cb for cb in cbs if isinstance(cb, ModelCheckpoint)
    ]


def _build_loggers(logger: Any, default_root_dir: str | Path, fast_dev_run: bool) -> list[Logger]:
    """``True`` -> a CSVLogger; ``False``/None -> none; loggers without a save_dir get the root dir."""
    if fast_dev_run or logger is False or logger is None:
        return []
    loggers = [CSVLogger()] if logger is True else [logger] if isinstance(logger, Logger) else list(logger)
    for lg in loggers:
        lg.set_default_save_dir(default_root_dir)
    return loggers
