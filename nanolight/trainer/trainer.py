"""`NanoTrainer`: Lightning's ``Trainer`` -- the same arguments, entry points and hook order --
over a `Strategy` that owns every question of parallel layout (the trainer has no parallel code).

Its parts, each in its own file: `config.py` (the loop options), `connect.py` (accelerator /
devices -> strategy), `data.py` (where loaders come from), `loops.py` (fit), `step.py` /
`manual.py` (one step), `evaluation.py` (validate / test / predict), `metrics.py` +
`results.py` (``self.log``), `log_rows.py` (rows for the loggers), `lifecycle.py` (one
call: setup, the stage, teardown), `optimization.py`
(backward, optimizer steps, clipping, schedulers), `hooks.py` (calling hooks), `state.py` (the
trainer's part of a checkpoint), `properties.py` (what users read), `preemption.py` (SIGTERM).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from nanolight.callbacks.base import Callback
from nanolight.checkpoint.atomic import LAST_POINTER, resolve_checkpoint, write_last_pointer
from nanolight.checkpoint.files import CheckpointError, with_hint
from nanolight.errors import UsageError
from nanolight.module import NanoDataModule, NanoModule
from nanolight.trainer.builders import build_callbacks, build_loggers
from nanolight.trainer.config import TrainerConfig, unsupported_args
from nanolight.trainer.connect import planned_processes, resolve_strategy
from nanolight.trainer.data import DataConnector
from nanolight.trainer.evaluation import run_evaluation, run_predict
from nanolight.trainer.hooks import HookCaller
from nanolight.trainer.lifecycle import RunLifecycle, print_results
from nanolight.trainer.log_rows import LogRows
from nanolight.trainer.loops import FitLoop
from nanolight.trainer.metrics import MetricStore
from nanolight.trainer.optimization import Optimization
from nanolight.trainer.preemption import Preemption
from nanolight.trainer.properties import TrainerProperties, TrainerState
from nanolight.trainer.state import build_state


class NanoTrainer(TrainerProperties, RunLifecycle, HookCaller, Optimization, LogRows):
    """Lightning-style trainer: ``NanoTrainer(max_epochs=3).fit(module, datamodule=dm)``.
    `seed` (nanolight) seeds everything at the start of every call."""

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: Any = "auto",
        devices: Any = "auto",
        num_nodes: int = 1,
        precision: str | None = None,
        logger: Any = None,
        callbacks: list[Callback] | Callback | None = None,
        fast_dev_run: int | bool = False,
        max_epochs: int | None = None,
        min_epochs: int | None = None,
        max_steps: int = -1,
        min_steps: int | None = None,
        max_time: Any = None,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        overfit_batches: int | float = 0.0,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int | None = None,
        log_every_n_steps: int | None = None,
        enable_checkpointing: bool | None = None,
        enable_progress_bar: bool | None = None,
        enable_model_summary: bool | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
        deterministic: bool | str | None = None,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        use_distributed_sampler: bool = True,
        detect_anomaly: bool = False,
        barebones: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
        default_root_dir: str | Path | None = None,
        enable_autolog_hparams: bool = True,
        seed: int | None = None,
        **unsupported: Any,
    ) -> None:
        unsupported_args(unsupported)
        if barebones:
            on = [k for k, v in {"logger": logger, "enable_checkpointing": enable_checkpointing,
                                  "enable_progress_bar": enable_progress_bar,
                                  "enable_model_summary": enable_model_summary}.items() if v]  # fmt: skip
            if on:
                raise UsageError(f"barebones=True turns off {on}: drop them or barebones")
            logger, enable_checkpointing, enable_progress_bar, enable_model_summary = (
                False,
                False,
                False,
                False,
            )
            log_every_n_steps = 0
        self.config = TrainerConfig(
            max_steps, max_epochs, min_steps, min_epochs, max_time, accumulate_grad_batches,
            gradient_clip_val, gradient_clip_algorithm, val_check_interval, check_val_every_n_epoch,
            num_sanity_val_steps, limit_train_batches, limit_val_batches, limit_test_batches,
            limit_predict_batches, overfit_batches, log_every_n_steps, fast_dev_run,
            reload_dataloaders_every_n_epochs,
        )  # fmt: skip
        self.barebones, self.seed, self.inference_mode = barebones, seed, inference_mode
        self.deterministic, self.benchmark, self.detect_anomaly = deterministic, benchmark, detect_anomaly
        self.use_distributed_sampler, self.enable_autolog_hparams = (
            use_distributed_sampler,
            enable_autolog_hparams,
        )
        self.default_root_dir = str(default_root_dir or os.getcwd())
        self.strategy = resolve_strategy(strategy, accelerator, devices, num_nodes, precision)
        self.num_nodes, self.num_devices = num_nodes, planned_processes(self.strategy) // max(num_nodes, 1)
        fast = bool(self.config.fast_dev_run)
        self._base_callbacks = build_callbacks(
            callbacks, enable_checkpointing is not False, enable_progress_bar is not False,
            enable_model_summary is not False and not fast,
        )  # fmt: skip
        self.callbacks = list(self._base_callbacks)
        self.loggers = build_loggers(logger, self.default_root_dir, fast)
        self.progress = {"global_step": 0, "epoch": 0, "batch_idx": 0, "samples": 0, "tokens": 0,
                         "stepped": 0, "total_batch_idx": 0}  # fmt: skip
        self.state = TrainerState()
        self.lr_scheduler_configs: list[Any] = []
        self.nano_optimizers: list[Any] = []
        self.lightning_module: NanoModule | None = None
        self.datamodule: NanoDataModule | None = None
        self.data = DataConnector(self)
        self.should_stop = False
        self.preempted_by: str | None = None  # "SIGTERM"/"SIGUSR1" if a signal stopped the fit
        self.preemption = Preemption(self)
        self.skip_optimizer_step = False  # set by a callback (NaNGuard) in on_before_optimizer_step
        self.step_loss: torch.Tensor | None = None  # this step's mean loss, the same on every rank
        self.grad_norm: torch.Tensor | None = None  # the pre-clip global norm of the last clipping
        self.ckpt_path: str | None = None  # the checkpoint the last call restored
        self.num_training_batches: int | float = float("inf")
        self.num_val_batches: list[int | float] = []
        self.num_sanity_val_batches: list[int | float] = []
        self.num_test_batches: list[int | float] = []
        self.num_predict_batches: list[int | float] = []
        self.metrics = MetricStore(self.strategy.reduce)
        self.fit_loop = FitLoop(self)
        self._hook_targets: dict[str, list[tuple[Any, bool]]] = {}
        self._eval_rows: dict[int, int] = {}

    # ---- entry points ------------------------------------------------------------------
    def fit(
        self,
        model: NanoModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: NanoDataModule | None = None,
        ckpt_path: str | Path | None = None,
    ) -> None:
        if isinstance(train_dataloaders, NanoDataModule):
            datamodule, train_dataloaders = train_dataloaders, None
        self.data.attach(model, datamodule, train=train_dataloaders, val=val_dataloaders)
        with self.preemption:  # SIGTERM/SIGUSR1: finish the step, save, stop (preemption.py)
            self._run("fit", model, ckpt_path, self._fit_stage)

    def validate(self, model: NanoModule | None = None, dataloaders: Any = None, ckpt_path: str | Path | None = None,
                 verbose: bool = True, datamodule: NanoDataModule | None = None) -> list[dict[str, float]]:  # fmt: skip
        """One validation pass; returns its metrics, one dict per dataloader."""
        return self._evaluate("validate", "val", model, dataloaders, ckpt_path, verbose, datamodule)

    def test(self, model: NanoModule | None = None, dataloaders: Any = None, ckpt_path: str | Path | None = None,
             verbose: bool = True, datamodule: NanoDataModule | None = None) -> list[dict[str, float]]:  # fmt: skip
        """One test pass (``test_step``); returns its metrics, one dict per dataloader."""
        return self._evaluate("test", "test", model, dataloaders, ckpt_path, verbose, datamodule)

    def predict(self, model: NanoModule | None = None, dataloaders: Any = None, datamodule: NanoDataModule | None = None,
                return_predictions: bool | None = None, ckpt_path: str | Path | None = None) -> Any:  # fmt: skip
        """What ``predict_step`` returns, per batch (a list per dataloader when there are several)."""
        model, datamodule, dataloaders = self._call_args("predict", model, datamodule, dataloaders)
        self.data.attach(model, datamodule, predict=dataloaders)
        out: list[Any] = []
        keep = True if return_predictions is None else return_predictions
        self._run("predict", model, ckpt_path, lambda: out.append(run_predict(self, self.data.request("predict"), keep)),
                  model_given=self._model_given)  # fmt: skip
        return out[0]

    def _evaluate(self, fn: str, kind: str, model: Any, dataloaders: Any, ckpt_path: Any, verbose: bool,
                  datamodule: Any) -> list[dict[str, float]]:  # fmt: skip
        model, datamodule, dataloaders = self._call_args(fn, model, datamodule, dataloaders)
        self.data.attach(model, datamodule, **{kind: dataloaders})
        out: list[list[dict[str, float]]] = []

        def stage() -> None:
            self.state.stage = fn
            out.append(run_evaluation(self, kind, self.data.request(kind)))
            if verbose and self.is_global_zero:
                print_results(fn, out[0])

        self._run(fn, model, ckpt_path, stage, model_given=self._model_given)
        return out[0]

    def _call_args(self, fn: str, model: Any, datamodule: Any, dataloaders: Any) -> tuple[Any, Any, Any]:
        if isinstance(dataloaders, NanoDataModule):
            datamodule, dataloaders = dataloaders, None
        self._model_given = model is not None
        if model is None:
            model = self.lightning_module
            if model is None:
                raise UsageError(f"{fn}() needs a model: pass {fn}(model, ...) or call fit(model) first")
        return model, datamodule, dataloaders

    # ---- checkpoints -------------------------------------------------------------------
    def save_checkpoint(
        self, filepath: str | Path, weights_only: bool = False, update_last: bool = True
    ) -> None:
        """Save a checkpoint directory at `filepath` (all ranks call this) and move the ``last``
        pointer next to it (nanolight: a pointer file, where Lightning copies ``last.ckpt``)."""
        path = Path(filepath)
        try:
            self.strategy.save_checkpoint(path, build_state(self, weights_only), weights_only=weights_only)
        except CheckpointError as exc:  # e.g. a full disk: the save's temporary directory is gone
            last = resolve_checkpoint(path.parent / LAST_POINTER)
            where = f"`last` still points at {last.name}" if last else "there is no earlier checkpoint"
            raise with_hint(exc, f"nothing of {path.name} was published, {where}") from exc
        if update_last and self.is_global_zero:
            write_last_pointer(path)
        self.strategy.barrier("last_pointer")

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank zero only."""
        if self.is_global_zero:
            print(*args, **kwargs)
