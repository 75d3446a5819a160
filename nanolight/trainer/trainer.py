"""`NanoTrainer`: Lightning's ``Trainer`` -- the same arguments, entry points and hook order --
over a `Strategy` that owns every question of parallel layout (the trainer has no parallel code).

The trainer holds its parts as objects, each with its own state (Lightning's connectors; the
package docstring names them). This file is one call from start to end: the environment,
``prepare_data`` / ``setup``, the model set up on the strategy, the optimizers, the checkpoint
restored (for fit, its optimizers and loop progress after ``on_fit_start``, as Lightning), hparams logged; then the stage (fit: the sanity check and the fit loop); then teardown,
loggers finalised, or ``on_exception``.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.overrides import is_overridden
from lightning_utilities.core.rank_zero import rank_zero_info

from nanolight.callbacks.base import Callback
from nanolight.checkpoint.atomic import (
    LAST_POINTER,
    CheckpointError,
    resolve_checkpoint,
    with_hint,
    write_last_pointer,
)
from nanolight.errors import UsageError
from nanolight.module import NanoDataModule, NanoModule
from nanolight.module.hparams import drop_unpicklable
from nanolight.seed import capture_rng_state, restore_rng_state, seed_everything
from nanolight.trainer.arguments import (
    TrainerConfig,
    build_callbacks,
    build_loggers,
    planned_processes,
    resolve_strategy,
    set_determinism,
    unsupported_args,
)
from nanolight.trainer.data import DataConnector
from nanolight.trainer.evaluation import run_evaluation, run_predict
from nanolight.trainer.hooks import HookCaller, merge_model_callbacks
from nanolight.trainer.loops import FitLoop
from nanolight.trainer.metrics import MetricStore
from nanolight.trainer.optimization import Optimization
from nanolight.trainer.preemption import Preemption
from nanolight.trainer.properties import TrainerProperties
from nanolight.trainer.state import build_state, resolve_ckpt_path, restore_state, restore_training_state
from nanolight.trainer.states import TrainerState

# the counters of `trainer.progress`: optimizer steps, epochs, batches in the epoch, samples and
# tokens seen (over dp), batches that stepped (the logger's step), batches over all epochs
PROGRESS_KEYS = ("global_step", "epoch", "batch_idx", "samples", "tokens", "stepped", "total_batch_idx")
NEEDS = {
    "fit": ["training_step", "configure_optimizers"],
    "validate": ["validation_step"],
    "test": ["test_step"],
}


class NanoTrainer(TrainerProperties):
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
            switches = {  # Lightning's: each would cost raw speed, so asking for one is an error
                "logger": logger,
                "enable_checkpointing": enable_checkpointing,
                "enable_progress_bar": enable_progress_bar,
                "enable_model_summary": enable_model_summary,
                "log_every_n_steps": log_every_n_steps,
                "num_sanity_val_steps": num_sanity_val_steps,
                "fast_dev_run": fast_dev_run,
                "detect_anomaly": detect_anomaly,
            }
            on = [k for k, v in switches.items() if v]
            if on:
                raise UsageError(f"barebones=True turns off {on}: drop them or barebones")
            logger = enable_checkpointing = enable_progress_bar = enable_model_summary = False
            log_every_n_steps = num_sanity_val_steps = 0
        args = locals()  # the loop options, by their names (barebones' changes included)
        self.config = TrainerConfig(**{f.name: args[f.name] for f in fields(TrainerConfig)})
        self.barebones, self.seed, self.inference_mode = barebones, seed, inference_mode
        self.deterministic, self.benchmark, self.detect_anomaly = deterministic, benchmark, detect_anomaly
        self.use_distributed_sampler = use_distributed_sampler
        self.enable_autolog_hparams = enable_autolog_hparams
        self.default_root_dir = str(default_root_dir or os.getcwd())
        self.strategy = resolve_strategy(strategy, accelerator, devices, num_nodes, precision)
        self.num_nodes, self.num_devices = num_nodes, planned_processes(self.strategy) // max(num_nodes, 1)
        fast = bool(self.config.fast_dev_run)
        checkpointing, progress_bar = enable_checkpointing is not False, enable_progress_bar is not False
        summary = enable_model_summary is not False and not fast
        self._base_callbacks = build_callbacks(
            callbacks, checkpointing, progress_bar, summary, self.config.max_time_s
        )
        self.callbacks = list(self._base_callbacks)
        self.loggers = build_loggers(logger, self.default_root_dir, fast)
        self.progress = dict.fromkeys(PROGRESS_KEYS, 0)
        self.state = TrainerState()
        self.lightning_module: NanoModule | None = None
        self.datamodule: NanoDataModule | None = None
        # the parts, each holding its own state
        self.hooks = HookCaller(self)
        self.data = DataConnector(self)
        self.metrics = MetricStore(self)
        self.optimization = Optimization(self)
        self.fit_loop = FitLoop(self)
        self.preemption = Preemption(self)
        # what callbacks and users read and set
        self.lr_scheduler_configs: list[Any] = []
        self.nano_optimizers: list[Any] = []
        self.should_stop = False
        self.preempted_by: str | None = None  # "SIGTERM"/"SIGUSR1" if a signal stopped the fit
        self.skip_optimizer_step = False  # set by a callback (NaNGuard) in on_before_optimizer_step
        self.step_loss: torch.Tensor | None = None  # this step's mean loss, the same on every rank
        self.grad_norm: torch.Tensor | None = None  # the pre-clip global norm of the last clipping
        self.ckpt_path: str | None = None  # the checkpoint the last call restored
        self.num_training_batches: int | float = float("inf")
        self.num_val_batches: list[int | float] = []
        self.num_sanity_val_batches: list[int | float] = []
        self.num_test_batches: list[int | float] = []
        self.num_predict_batches: list[int | float] = []

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
        self.fit_loop.forget_data()
        with self.preemption:  # SIGTERM/SIGUSR1: finish the step, save, stop (preemption.py)
            self._run("fit", model, ckpt_path, self._fit_stage)

    def validate(
        self,
        model: NanoModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
        datamodule: NanoDataModule | None = None,
    ) -> list[dict[str, float]]:
        """One validation pass; returns its metrics, one dict per dataloader."""
        return self._non_fit_call("validate", model, dataloaders, datamodule, ckpt_path, verbose)

    def test(
        self,
        model: NanoModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
        datamodule: NanoDataModule | None = None,
    ) -> list[dict[str, float]]:
        """One test pass (``test_step``); returns its metrics, one dict per dataloader."""
        return self._non_fit_call("test", model, dataloaders, datamodule, ckpt_path, verbose)

    def predict(
        self,
        model: NanoModule | None = None,
        dataloaders: Any = None,
        datamodule: NanoDataModule | None = None,
        return_predictions: bool | None = None,
        ckpt_path: str | Path | None = None,
    ) -> Any:
        """What ``predict_step`` returns, per batch (a list per dataloader when there are several)."""
        keep = True if return_predictions is None else return_predictions
        return self._non_fit_call("predict", model, dataloaders, datamodule, ckpt_path, keep=keep)

    def _non_fit_call(
        self,
        fn: str,
        model: Any,
        dataloaders: Any,
        datamodule: Any,
        ckpt_path: Any,
        verbose: bool = False,
        keep: bool = True,
    ) -> Any:
        """validate / test / predict: the module (else the one fit ran), its loaders, one `_run`."""
        if isinstance(dataloaders, NanoDataModule):
            datamodule, dataloaders = dataloaders, None
        model_given = model is not None
        if model is None:
            model = self.lightning_module
            if model is None:
                raise UsageError(f"{fn}() needs a model: pass {fn}(model, ...) or call fit(model) first")
        kind = "val" if fn == "validate" else fn
        self.data.attach(model, datamodule, **{kind: dataloaders})

        def stage() -> Any:
            if fn == "predict":
                return run_predict(self, self.data.request(kind), keep)
            if getattr(self.config, f"limit_{kind}_batches") == 0:
                return []  # Lightning skips the loop: no loaders asked for, no hooks
            results = run_evaluation(self, kind, self.data.request(kind))
            if verbose and self.is_global_zero:
                print_results(fn, results)
            return results

        return self._run(fn, model, ckpt_path, stage, model_given=model_given)

    # ---- one call, start to end ----------------------------------------------------------
    def _run(self, fn: str, module: NanoModule, ckpt_path: Any, stage: Any, model_given: bool = True) -> Any:
        """`stage` inside one call's setup and teardown; returns what it returns."""
        check_module(module, fn)
        drop_unpicklable(module.hparams, type(module).__name__)  # Lightning cleans them at every call
        # the call's stage holds from setup to teardown, as in Lightning (the sanity check and
        # fit-time validation change it while they run)
        self.state.fn, self.state.stage, self.state.status = fn, "train" if fn == "fit" else fn, "running"
        self.lightning_module, module.trainer, self.datamodule = module, self, self.data.datamodule
        self.hooks.reset()
        if fn == "fit":  # only fit clears it: a later test still sees an EarlyStopping's stop (Lightning)
            self.should_stop = False
        self.callbacks = merge_model_callbacks(self._base_callbacks, self.hooks.module("configure_callbacks"))
        self.metrics.reset()
        self.metrics.active = self.metrics.train
        with set_determinism(self.deterministic, self.benchmark):
            try:
                self._setup(fn, module, ckpt_path, model_given)
                with self.strategy.watch(f"{fn} (a collective outside the watched training step)"):
                    if fn != "fit":  # Lightning zeroes the module's gradients before every stage
                        module.zero_grad()
                    result = stage()
                self.state.status = "finished"
                for lg in self.loggers if self.is_global_zero else []:
                    lg.finalize("success")
                self.hooks.setup("teardown", self.state.fn)
                return result
            except BaseException as exc:
                self.state.status = "interrupted"
                self.hooks.call("on_exception", exc)
                for lg in self.loggers if self.is_global_zero else []:
                    lg.finalize("failed")
                raise
            finally:
                self.state.stage = None
                self.strategy.teardown()

    def _setup(self, fn: str, module: NanoModule, ckpt_path: Any, model_given: bool) -> None:
        strategy = self.strategy
        strategy.setup_environment()
        if self.logger is not None:  # every rank agrees on rank 0's (new) log directory
            self._log_dir = strategy.broadcast(self.logger.log_dir if self.is_global_zero else None)
        if self.seed is not None:
            seed_everything(self.seed, verbose=False)
        self._prepare_data()
        self.hooks.setup("setup", self.state.fn)  # TrainerFn, as Lightning
        # Lightning calls configure_model (as prepare_data) only when the class overrides it
        if is_overridden("configure_model", module, NanoModule):
            with strategy.tensor_init_context():  # every call, as Lightning (it must be idempotent)
                self.hooks.module("configure_model")
        if strategy.module is not module:  # parallelised once per trainer
            strategy.setup_module(module)
        self.metrics.always_sync = strategy.parallel.metrics_always_sync
        path = resolve_ckpt_path(self, ckpt_path, fn, model_given)
        self._training_state: tuple[Path, dict[str, Any]] | None = None  # restored after on_fit_start
        self.ckpt_path = str(path) if path is not None else None
        if path is not None:
            rank_zero_info(f"Restoring from checkpoint {path}")
            state = restore_state(self, path)
            if fn == "fit":
                self._training_state = path, state
        if fn == "fit":  # after the weights and the checkpoint hooks, as Lightning's strategy setup
            self.optimization.setup(module)
        self._log_hyperparams(module)

    def _prepare_data(self) -> None:
        """``prepare_data`` on local rank 0 of each node (or global rank 0), the others wait."""
        module, dm = self.lightning_module, self.datamodule
        per_node = getattr(dm if dm is not None else module, "prepare_data_per_node", True)
        if (self.local_rank if per_node else self.global_rank) == 0:  # only overrides, as Lightning
            if dm is not None and is_overridden("prepare_data", dm, NanoDataModule):
                self.hooks.datamodule("prepare_data")
            if is_overridden("prepare_data", module, NanoModule):
                self.hooks.module("prepare_data")
        self.strategy.barrier("prepare_data")  # every rank waits for the ranks that prepared data

    def _log_hyperparams(self, module: NanoModule) -> None:
        """The module's and datamodule's saved hparams to every logger (rank 0), when there are any;
        every logger saves, so its version directory exists from the call's start (Lightning)."""
        if not (self.enable_autolog_hparams and self.is_global_zero and self.loggers):
            return
        params: dict[str, Any] = {}
        for owner in (self.datamodule, module):
            if owner is not None and owner.logs_hyperparameters:
                clash = sorted(
                    k for k in owner.hparams_initial if k in params and params[k] != owner.hparams_initial[k]
                )
                if clash:
                    raise UsageError(
                        f"the module and datamodule save different values for the hparams {clash}"
                    )
                params.update(owner.hparams_initial)
        for lg in self.loggers:  # saved even without hparams: each trainer call has its log directory
            if params:
                lg.log_hyperparams(params)
            lg.save()

    def _fit_stage(self) -> None:
        with torch.autograd.set_detect_anomaly(self.detect_anomaly):  # as Lightning (False: off)
            self.hooks.call("on_fit_start")
            if self._training_state is not None:  # optimizers and loop progress (Lightning's _run)
                restore_training_state(self, *self._training_state)
            self.lightning_module.zero_grad()  # before the stage, as for validate/test/predict
            if (
                self.enable_validation
                and self.config.num_sanity_val_steps != 0
                and not self.fit_loop.restarting
            ):
                self._sanity_check()
            self.fit_loop.run()
            self.hooks.call("on_fit_end")

    def _sanity_check(self) -> None:
        """A short validation before training, its RNG use undone and its metrics not kept."""
        rng = capture_rng_state()
        self.state.stage = "sanity_check"
        self.hooks.call("on_sanity_check_start")
        run_evaluation(self, "val", self.fit_loop.ensure_val_data(), sanity=True)
        self.hooks.call("on_sanity_check_end")
        self.metrics.reset()
        restore_rng_state(rng)
        self.state.stage = "train"

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
        self.strategy.barrier("last_pointer")  # every rank: global rank 0 has moved the pointer

    # ---- what modules and callbacks call -------------------------------------------------
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Send `metrics` (floats or scalar tensors) to every logger (global rank zero writes).
        Without `step`: at the current `log_step`, with an ``epoch`` column."""
        self.metrics.log_row(metrics, step)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``manual_backward``: backward with its hooks, through the strategy (`args`, `kwargs`:
        for ``Tensor.backward``, e.g. ``retain_graph=True``)."""
        self.optimization.backward(loss, backward_args=(args, kwargs))

    def clip_gradients(
        self, optimizer: Any, value: float | None, algorithm: str | None
    ) -> torch.Tensor | None:
        """``NanoModule.clip_gradients``: Lightning's rules, the norm over every parallel rank."""
        return self.optimization.clip_gradients(optimizer, value, algorithm)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank zero only."""
        if self.is_global_zero:
            print(*args, **kwargs)


def check_module(module: Any, fn: str) -> None:
    """What a call needs from the module, checked before anything runs."""
    if not isinstance(module, NanoModule):
        raise UsageError(f"expected a NanoModule, got {type(module).__name__}")
    for step in ("training_step", "validation_step", "test_step", "predict_step"):
        fn = getattr(module, step, None)  # (a program may set a step to None to drop it)
        if callable(fn) and "dataloader_iter" in inspect.signature(fn).parameters:
            raise UsageError(
                f"{step}(dataloader_iter) is not supported: the trainer fetches the batches (a step's "
                f"micro-batch schedule, a resumable data position); take {step}(batch, batch_idx)"
            )
    missing = [h for h in NEEDS.get(fn, []) if not is_overridden(h, module, NanoModule)]
    if missing:
        raise UsageError(f"{type(module).__name__} must implement {' and '.join(missing)} for trainer.{fn}()")


def print_results(fn: str, results: list[dict[str, float]]) -> None:
    """The metrics of a validate / test call, as a table (global rank zero)."""
    for i, metrics in enumerate(results):
        if not metrics:
            continue
        width = max(len(k) for k in metrics)
        title = f"{fn.capitalize()} metric" + (f" (dataloader {i})" if len(results) > 1 else "")
        print(
            f"{title:<{width}}  value\n"
            + "\n".join(f"{k:<{width}}  {v:.6g}" for k, v in sorted(metrics.items()))
        )
