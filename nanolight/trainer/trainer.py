"""`NanoTrainer`: the training loop. It owns callbacks, loggers and a strategy, and asks the
strategy every question whose answer depends on the parallel layout (it has no parallel code).

One optimizer step = ``accumulate_grad_batches`` micro-batches handed *together* to
`Strategy.training_step`, so a pipeline strategy can schedule them (1F1B); the strategy calls
back `MicroStep` (hooks + ``training_step``) per micro-batch. ``batch_idx`` given to hooks and
``training_step`` counts micro-batches within the epoch, as in Lightning; ``global_step``
counts optimizer steps. Hook order follows Lightning's documented pseudocode (callbacks first,
then the module).
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
from nanolight.checkpoint.trainer_state import restore_rng_state, write_last_pointer
from nanolight.loggers.base import Logger
from nanolight.loop import data
from nanolight.loop.checkpoint import build_state, resolve_ckpt_path, restore_state, restore_training_state
from nanolight.loop.config import TrainerConfig
from nanolight.loop.metrics import MetricStore
from nanolight.loop.optim import SchedulerConfig, parse_optimizers, step_scheduler
from nanolight.loop.preemption import Preemption
from nanolight.loop.setup import build_callbacks, build_loggers, seed_everything
from nanolight.loop.step import MicroStep
from nanolight.module import NanoModule
from nanolight.precision import Precision
from nanolight.strategies.base import Strategy
from nanolight.strategies.single_device import SingleDeviceStrategy


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
        self.callbacks = build_callbacks(callbacks, enable_checkpointing, enable_progress_bar, fast)
        self.loggers = build_loggers(logger, self.default_root_dir, fast)
        self.progress = {"global_step": 0, "epoch": 0, "batch_idx": 0, "samples": 0, "tokens": 0}
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self.lightning_module: NanoModule | None = None
        self.should_stop = False
        self.preempted_by: str | None = None  # "SIGTERM"/"SIGUSR1" if a signal stopped the fit
        self._preemption = Preemption(self)
        self.skip_optimizer_step = False  # set by a callback (NaNGuard) in on_before_optimizer_step
        self.is_step_end = False  # True while the last micro-batch's on_train_batch_end runs
        self.step_loss: torch.Tensor | None = None
        self.grad_norm: torch.Tensor | None = None
        self.logged_metrics: dict[str, float] = {}
        self._metrics = MetricStore()
        self._hooks: dict[str, list[tuple[Any, bool]]] = {}
        self._was_deterministic = False
        self._resume_loop: dict[str, Any] | None = None
        self._resume_rng: dict[str, Any] | None = None
        self._epoch_start: dict[str, Any] | None = None
        self._train_loader: Any = None

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
        return self._metrics.callback_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, torch.Tensor]:
        return self._metrics.progress_bar_metrics

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

    # ---- hooks & logging ---------------------------------------------------------------
    def _call_hook(self, name: str, *args: Any) -> None:
        """Callbacks (in order) then the module, as Lightning does; only overridden hooks are
        called (resolved once per run: a step fires ~10 hooks per micro-batch)."""
        targets = self._hooks.get(name)
        if targets is None:
            module = self.lightning_module
            targets = [getattr(cb, name) for cb in self.callbacks if is_overridden(name, cb, Callback)]
            self._hooks[name] = targets = [(fn, True) for fn in targets] + (
                [(getattr(module, name), False)] if is_overridden(name, module, NanoModule) else []
            )
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
        with self._preemption:  # SIGTERM/SIGUSR1: finish the step, save, stop (loop/preemption.py)
            self._run("fit", module, ckpt_path, lambda: self._fit_loop(train_dataloaders, val_dataloaders))

    def validate(
        self, module: NanoModule, dataloaders: Iterable, ckpt_path: str | Path | None = None
    ) -> dict:
        """Run one validation epoch; returns its epoch metrics."""
        result: dict[str, Any] = {}
        self._run("validate", module, ckpt_path, lambda: result.update(self._validation_loop(dataloaders)))
        return {k: float(v) for k, v in result.items()}

    def _run(self, stage: str, module: NanoModule, ckpt_path: Any, loop: Any) -> None:
        if not isinstance(module, NanoModule):
            raise TypeError(f"expected a NanoModule, got {type(module).__name__}")
        self.lightning_module, module.trainer = module, self
        self._hooks = {}
        self.should_stop = False
        try:
            self._setup(stage, module, ckpt_path)
            loop()
            for lg in self.loggers if self.is_global_zero else []:
                lg.finalize("success")
            self._call_hook("teardown", stage)
        except BaseException as exc:
            self._call_hook("on_exception", exc)
            for lg in self.loggers if self.is_global_zero else []:
                lg.finalize("failed")
            raise
        finally:
            self.strategy.teardown()
            if self.config.deterministic:
                torch.use_deterministic_algorithms(self._was_deterministic)

    def _setup(self, stage: str, module: NanoModule, ckpt_path: Any) -> None:
        cfg = self.config
        self.strategy.setup_environment()
        if cfg.seed is not None:
            seed_everything(cfg.seed)
        if cfg.deterministic:  # restored after the run (it is process-global)
            self._was_deterministic = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(True)
        self._call_hook("setup", stage)
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

    # ---- training ----------------------------------------------------------------------
    def _done(self) -> bool:
        cfg = self.config
        return (
            self.should_stop
            or (cfg.max_steps >= 0 and self.global_step >= cfg.max_steps)
            or (cfg.max_epochs is not None and self.current_epoch >= cfg.max_epochs)
        )

    def _fit_loop(self, train_loader: Iterable, val_loader: Iterable | None) -> None:
        self._train_loader, module = train_loader, self.lightning_module
        self._call_hook("on_fit_start")
        module.train()
        self._call_hook("on_train_start")
        while not self._done():
            self._train_epoch(train_loader, val_loader)
        self._call_hook("on_train_end")
        self._call_hook("on_fit_end")

    def _epoch_iterator(self, loader: Iterable) -> Any:
        """Iterator for the current epoch, positioned after the batches a checkpoint consumed."""
        resume, self._resume_loop = self._resume_loop, None
        stateful = data.is_stateful(loader)
        data.set_epoch(loader, self.current_epoch)
        if resume is not None and stateful and resume.get("loader") is not None:
            loader.load_state_dict(resume["loader"])
        if resume is not None:
            data.restore_epoch_start(loader, resume["epoch_start"])
        self._epoch_start = data.capture_epoch_start(loader)
        iterator = iter(loader)
        if resume is not None and not stateful:
            data.skip(iterator, resume["batch_idx"])
        if self._resume_rng is not None:
            restore_rng_state(self._resume_rng)
            self._resume_rng = None
        if resume is None:
            self.progress["batch_idx"] = 0
        return iterator

    def _loop_state(self) -> dict[str, Any]:
        loader = self._train_loader
        return {
            "batch_idx": self.progress["batch_idx"],
            "epoch_start": self._epoch_start,
            "loader": loader.state_dict() if data.is_stateful(loader) else None,
        }

    def _train_epoch(self, loader: Iterable, val_loader: Iterable | None) -> None:
        cfg = self.config
        iterator = self._epoch_iterator(loader)
        self._call_hook("on_train_epoch_start")
        while not self._done():
            batches = data.take(iterator, cfg.accumulate_grad_batches)
            if not batches:
                if self.progress["batch_idx"] == 0:
                    raise ValueError(
                        "the train dataloader yielded no batches: check the dataset and batch size"
                    )
                break
            self._train_step(batches)
            if (
                val_loader is not None
                and cfg.val_check_interval
                and self.global_step % cfg.val_check_interval == 0
            ):
                self._validation_loop(val_loader)
        if val_loader is not None and cfg.val_check_interval is None and not self.should_stop:
            self._validation_loop(val_loader)
        self._metrics.stage = "train"
        self.log_metrics(self._metrics.finish_epoch(self.strategy.reduce))
        self._call_hook("on_train_epoch_end")
        for sc in self.lr_scheduler_configs:
            if sc.interval == "epoch" and (self.current_epoch + 1) % sc.frequency == 0:
                step_scheduler(sc, self.callback_metrics)
        self.progress["epoch"] += 1
        self.progress["batch_idx"] = 0

    def _train_step(self, batches: list[Any]) -> None:
        strategy, cfg = self.strategy, self.config
        batches = [strategy.batch_to_device(b) for b in batches]
        step = MicroStep(self, self.progress["batch_idx"], len(batches))
        loss = strategy.training_step(batches, step)
        self.progress["batch_idx"] += len(batches)
        self.step_loss = loss
        self.skip_optimizer_step = False
        for opt in strategy.optimizers:
            self._call_hook("on_before_optimizer_step", opt)
        if self.skip_optimizer_step:
            for opt in strategy.optimizers:
                strategy.zero_grad(opt)
        else:
            if cfg.gradient_clip_val is not None:
                self.grad_norm = strategy.clip_gradients(cfg.gradient_clip_val)
            for opt in strategy.optimizers:
                strategy.optimizer_step(opt)
        data.count_consumed(self.progress, batches, strategy.data_parallel_size)
        self.progress["global_step"] += 1
        if not self.skip_optimizer_step:
            for sc in self.lr_scheduler_configs:
                if sc.interval == "step" and self.global_step % sc.frequency == 0:
                    step_scheduler(sc, self.callback_metrics)
        self._finish_step_metrics(loss)
        self.is_step_end = True
        try:
            step.finish()
        finally:
            self.is_step_end = False
        self._preemption.check()

    def _finish_step_metrics(self, loss: torch.Tensor) -> None:
        metrics = self._metrics
        if not metrics.has("train/loss"):  # train/loss is always reported: the global-batch mean
            metrics.log("train/loss", loss, True, True, True, False, False)
        out = metrics.finish_step(self.strategy.reduce, always_sync=frozenset({"train/loss"}))
        if self.grad_norm is not None:
            metrics.callback_metrics["grad_norm"] = self.grad_norm.detach()
            out["grad_norm"] = self.grad_norm
        if self.should_log:
            self.log_metrics({**out, "epoch": self.current_epoch})

    # ---- validation --------------------------------------------------------------------
    @torch.no_grad()
    def _validation_loop(self, loader: Iterable) -> dict[str, float]:
        module, strategy = self.lightning_module, self.strategy
        limit = self.config.val_batches(data.loader_len(loader))
        was_training = module.training
        module.eval()
        self._metrics.stage = "val"
        try:
            self._call_hook("on_validation_start")
            self._call_hook("on_validation_epoch_start")
            for idx, batch in enumerate(loader):
                if limit is not None and idx >= limit:
                    break
                batch = strategy.batch_to_device(batch)
                self._call_hook("on_validation_batch_start", batch, idx)
                with strategy.autocast():
                    out = module.validation_step(batch, idx)
                self._call_hook("on_validation_batch_end", out, batch, idx)
            self._call_hook("on_validation_epoch_end")
            metrics = self._metrics.finish_epoch(strategy.reduce)
            self.log_metrics(metrics)
            self._call_hook("on_validation_end")
        finally:
            self._metrics.stage = "train"
            module.train(was_training)
        return metrics

    # ---- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path, update_last: bool = True) -> None:
        """Save a full training checkpoint to directory ``path`` (all ranks must call this)."""
        path = Path(path)
        self.strategy.save_checkpoint(path, build_state(self))
        if update_last and self.is_global_zero:
            write_last_pointer(path)
        self.strategy.barrier("last_pointer")
