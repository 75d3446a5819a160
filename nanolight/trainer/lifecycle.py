"""One call of the trainer (fit / validate / test / predict), start to end: the environment,
``prepare_data`` / ``setup``, the model set up on the strategy, the optimizers, the checkpoint
restored, hparams logged; then the stage (fit: the sanity check and the fit loop); then
teardown, loggers finalised, or ``on_exception``. A mixin of `NanoTrainer`.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from lightning_utilities.core.overrides import is_overridden
from lightning_utilities.core.rank_zero import rank_zero_info

from nanolight.errors import UsageError
from nanolight.module import NanoDataModule, NanoModule
from nanolight.seed import capture_rng_state, restore_rng_state, seed_everything
from nanolight.trainer.builders import check_module, set_determinism
from nanolight.trainer.evaluation import run_evaluation
from nanolight.trainer.hooks import merge_model_callbacks
from nanolight.trainer.state import resolve_ckpt_path, restore_state, restore_training_state


class RunLifecycle:
    """`NanoTrainer`'s `_run`: what every entry point does around its stage."""

    def _fit_stage(self) -> None:
        with ExitStack() as stack:
            if self.detect_anomaly:
                stack.enter_context(torch.autograd.set_detect_anomaly(True))
            self.call_hook("on_fit_start")
            self.lightning_module.zero_grad()  # before the stage, as for validate/test/predict
            if (
                self.enable_validation
                and self.config.num_sanity_val_steps != 0
                and not self.fit_loop.restarting
            ):
                self._sanity_check()
            self.state.stage = "train"
            self.fit_loop.run()
            self.call_hook("on_fit_end")

    def _sanity_check(self) -> None:
        """A short validation before training, its RNG use undone and its metrics not kept."""
        rng = capture_rng_state()
        self.state.stage = "sanity_check"
        self.call_hook("on_sanity_check_start")
        run_evaluation(self, "val", self.fit_loop.ensure_val_data(), sanity=True)
        self.call_hook("on_sanity_check_end")
        self.metrics.reset()
        restore_rng_state(rng)

    def _run(self, fn: str, module: NanoModule, ckpt_path: Any, stage: Any, model_given: bool = True) -> None:
        check_module(module, fn, self.strategy)
        self.state.fn, self.state.stage, self.state.status = fn, None, "running"
        self.lightning_module, module.trainer, self.datamodule = module, self, self.data.datamodule
        self._hook_targets, self._eval_rows = {}, {}
        if fn == "fit":  # only fit clears it: a later test still sees an EarlyStopping's stop (Lightning)
            self.should_stop = False
        self.callbacks = merge_model_callbacks(
            self._base_callbacks, self.call_module_hook("configure_callbacks")
        )
        self.metrics.reset()
        self.metrics.active = self.metrics.train
        with set_determinism(self.deterministic, self.benchmark):
            try:
                self._setup(fn, module, ckpt_path, model_given)
                with self.strategy.watch(f"{fn} (a collective outside the watched training step)"):
                    if fn != "fit":  # Lightning zeroes the module's gradients before every stage
                        module.zero_grad()
                    stage()
                self.state.status = "finished"
                for lg in self.loggers if self.is_global_zero else []:
                    lg.finalize("success")
                self.call_setup_hook("teardown", fn)
            except BaseException as exc:
                self.state.status = "interrupted"
                self.call_hook("on_exception", exc)
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
        self.call_setup_hook("setup", fn)
        # Lightning calls configure_model (as prepare_data) only when the class overrides it
        if is_overridden("configure_model", module, NanoModule):
            with strategy.model_init_context():  # every call, as Lightning (it must be idempotent)
                self.call_module_hook("configure_model")
        if strategy.module is not module:  # parallelised once per trainer
            strategy.setup_module(module)
        self.metrics.always_sync = strategy.pipelined  # only the last pipeline stage has the loss
        if fn == "fit":
            self.setup_optimization(module)
        path = resolve_ckpt_path(self, ckpt_path, fn, model_given)
        self.ckpt_path = str(path) if path is not None else None
        if path is not None:
            rank_zero_info(f"Restoring from checkpoint {path}")
            state = restore_state(self, path)
            if fn == "fit":
                restore_training_state(self, path, state)
        self._log_hyperparams(module)

    def _prepare_data(self) -> None:
        """``prepare_data`` on local rank 0 of each node (or global rank 0), the others wait."""
        module, dm = self.lightning_module, self.datamodule
        per_node = getattr(dm if dm is not None else module, "prepare_data_per_node", True)
        if (self.local_rank if per_node else self.global_rank) == 0:  # only overrides, as Lightning
            if dm is not None and is_overridden("prepare_data", dm, NanoDataModule):
                self.call_datamodule_hook("prepare_data")
            if is_overridden("prepare_data", module, NanoModule):
                self.call_module_hook("prepare_data")
        self.strategy.barrier("prepare_data")

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


def print_results(fn: str, results: list[dict[str, float]]) -> None:
    for i, metrics in enumerate(results):
        if not metrics:
            continue
        width = max(len(k) for k in metrics)
        title = f"{fn.capitalize()} metric" + (f" (dataloader {i})" if len(results) > 1 else "")
        print(
            f"{title:<{width}}  value\n"
            + "\n".join(f"{k:<{width}}  {v:.6g}" for k, v in sorted(metrics.items()))
        )
