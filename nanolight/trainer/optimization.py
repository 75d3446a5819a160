"""The trainer's optimization duties (its ``optimization`` part), for both kinds of optimization
(`step.py` says how each steps): the optimizers, backward with its hooks, the optimizer step
behind ``NanoOptimizer.step``, clipping, and the LR schedulers. The state callbacks read stays on
the trainer: ``lr_scheduler_configs``, ``nano_optimizers``, ``skip_optimizer_step``, ``grad_norm``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from nanolight.errors import UsageError
from nanolight.module.module import NanoModule
from nanolight.module.optimizers import NanoOptimizer, check_scheduler_api, parse_optimizers
from nanolight.trainer.arguments import clip_algorithm
from nanolight.trainer.step import refuse_under_pipeline

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer


def check_manual(module: Any, config: Any, strategy: Any) -> None:
    """Manual optimization: the trainer neither accumulates nor clips, and no pipeline schedule."""
    if module.automatic_optimization:
        return
    refuse_under_pipeline(
        strategy,
        "manual optimization cannot run under pipeline parallelism (manual_backward cannot drive a "
        "1F1B schedule): use automatic optimization, or pp=1",
    )
    if config.gradient_clip_val:
        raise UsageError(
            "NanoTrainer(gradient_clip_val=...) does not apply under manual optimization: call "
            "self.clip_gradients(opt, gradient_clip_val=..., gradient_clip_algorithm=...) in training_step"
        )
    if config.accumulate_grad_batches != 1:
        raise UsageError(
            "NanoTrainer(accumulate_grad_batches=...) does not apply under manual optimization: step the "
            "optimizer every N batches in training_step yourself"
        )


class Optimization:
    """Held by `NanoTrainer` as ``trainer.optimization``."""

    def __init__(self, trainer: NanoTrainer) -> None:
        self.trainer = trainer

    def setup(self, module: Any) -> None:
        """``configure_optimizers`` -> the strategy's (wrapped) optimizers, the schedulers, and the
        ``self.optimizers()`` objects, whose ``step`` goes through `optimizer_step`."""
        trainer = self.trainer
        check_manual(module, trainer.config, trainer.strategy)
        manual = not module.automatic_optimization
        if "optimizer_idx" in inspect.signature(module.training_step).parameters:
            raise UsageError(
                "training_step(batch, batch_idx, optimizer_idx) is Lightning 1.x: drop optimizer_idx and use "
                "manual optimization for several optimizers (opt1, opt2 = self.optimizers())"
            )
        configured = trainer.hooks.module("configure_optimizers")
        optimizers, trainer.lr_scheduler_configs = parse_optimizers(configured, manual)
        check_scheduler_api(trainer.lr_scheduler_configs, module, NanoModule)
        for opt in optimizers:
            closure = inspect.signature(opt.step).parameters.get("closure")
            if closure is not None and closure.default is inspect.Parameter.empty:
                raise UsageError(
                    f"{type(opt).__name__} re-evaluates the loss through a closure, which nanolight does not "
                    "support (a step's micro-batch schedule runs once): use a first-order optimizer"
                )
        if module.automatic_optimization and len(optimizers) > 1:
            raise UsageError(
                f"configure_optimizers returned {len(optimizers)} optimizers: several optimizers need manual "
                "optimization (self.automatic_optimization = False, then opt1, opt2 = self.optimizers() in "
                "training_step), or one optimizer with param groups"
            )
        strategy = trainer.strategy
        strategy.setup_optimizers(optimizers)
        trainer.nano_optimizers = [
            NanoOptimizer(opt, self.optimizer_step, strategy.zero_grad) for opt in trainer.optimizers
        ]

    def backward(
        self, loss: torch.Tensor, backward_args: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})
    ) -> None:
        """on_before_backward -> the module's ``backward`` (through the strategy) -> on_after_backward."""
        hooks = self.trainer.hooks
        hooks.call("on_before_backward", loss)
        args, kwargs = backward_args
        hooks.module("backward", loss, *args, **kwargs)
        hooks.call("on_after_backward")

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any] | None) -> Any:
        """``NanoOptimizer.step``. Automatic: the closure makes the gradients final and runs the
        hooks up to clipping. Manual: the gradients are finished here, then the hook runs."""
        trainer, strategy = self.trainer, self.trainer.strategy
        automatic = trainer.lightning_module.automatic_optimization
        if automatic and closure is None:
            raise UsageError("under automatic optimization optimizer.step needs the optimizer_closure")
        result = closure() if closure is not None else None
        if not automatic:
            strategy.finish_backward()
            trainer.hooks.call("on_before_optimizer_step", optimizer)
        if trainer.skip_optimizer_step:  # a callback (NaNGuard) vetoed this update
            strategy.zero_grad(optimizer)
        else:
            strategy.optimizer_step(optimizer)
        if not automatic:
            trainer.progress["global_step"] += 1
        return result

    def before_optimizer_step(self, optimizer: Any) -> None:
        """Automatic optimization, inside the closure: the hook, then the module's clipping."""
        trainer, cfg = self.trainer, self.trainer.config
        trainer.skip_optimizer_step = False
        trainer.hooks.call("on_before_optimizer_step", optimizer)
        trainer.hooks.module(  # the settings by keyword, as Lightning passes them
            "configure_gradient_clipping",
            optimizer,
            gradient_clip_val=cfg.gradient_clip_val,
            gradient_clip_algorithm=cfg.gradient_clip_algorithm,
        )

    def after_optimizer_step(self, last_of_epoch: bool) -> None:
        """Automatic optimization, after ``optimizer_step`` returned: count it, step the
        schedulers due (epoch ones at the epoch's last batch, as Lightning), publish the step's
        values before the last micro-batch's on_train_batch_end."""
        progress = self.trainer.progress
        progress["global_step"] += 1
        batch_idx = progress["batch_idx"] - 1
        if not self.trainer.skip_optimizer_step:  # a vetoed update does not advance the schedule
            self.update_lr_schedulers("step", plateau=False, batch_idx=batch_idx)
        if last_of_epoch:
            self.update_lr_schedulers("epoch", plateau=False, batch_idx=batch_idx)
        self.trainer.metrics.publish_step(sync=True)

    def clip_gradients(
        self, optimizer: Any, value: float | None, algorithm: str | None
    ) -> torch.Tensor | None:
        """Lightning's ``clip_gradients`` rules: `optimizer`'s parameters only (Lightning's
        ``Precision.main_params``); the norm goes through the strategy (summed over every parallel
        rank), returned and kept as the trainer's `grad_norm`."""
        trainer, cfg = self.trainer, self.trainer.config
        if value is None:
            value = cfg.gradient_clip_val or 0.0
        elif cfg.gradient_clip_val is not None and cfg.gradient_clip_val != value:
            raise UsageError(
                f"gradient_clip_val={value} passed to clip_gradients, but NanoTrainer(gradient_clip_val="
                f"{cfg.gradient_clip_val}) too: use one of them"
            )
        if algorithm is None:
            algorithm = cfg.gradient_clip_algorithm or "norm"
        elif cfg.gradient_clip_algorithm is not None and cfg.gradient_clip_algorithm != algorithm:
            raise UsageError(
                f"gradient_clip_algorithm={algorithm!r} passed to clip_gradients, but NanoTrainer("
                f"gradient_clip_algorithm={cfg.gradient_clip_algorithm!r}) too: use one of them"
            )
        algorithm = clip_algorithm(algorithm)
        if value <= 0:
            return None
        if algorithm == "value":
            trainer.strategy.clip_gradients(value, optimizer, "value")
            return None
        trainer.grad_norm = trainer.strategy.clip_gradients(value, optimizer)  # that optimizer's parameters
        return trainer.grad_norm

    # ---- LR schedulers -------------------------------------------------------------------
    def update_lr_schedulers(self, interval: str, plateau: bool, batch_idx: int) -> None:
        """Step the schedulers of `interval` due now (Lightning: plateau ones apart, after
        validation; a scheduler steps when its counter (batch or epoch, 1-based) hits `frequency`)."""
        trainer = self.trainer
        if not trainer.lightning_module.automatic_optimization:
            return  # manual optimization steps its schedulers itself
        for cfg in trainer.lr_scheduler_configs:
            if cfg.reduce_on_plateau != plateau or cfg.interval != interval:
                continue
            counter = (batch_idx if interval == "step" else trainer.current_epoch) + 1
            if counter % cfg.frequency:
                continue
            metric = None
            if cfg.reduce_on_plateau:
                metric = trainer.callback_metrics.get(cfg.monitor or "")
                if metric is None:
                    msg = (
                        f"ReduceLROnPlateau watches {cfg.monitor!r}, which was not logged; logged: "
                        f"{sorted(trainer.callback_metrics)}"
                    )
                    if cfg.strict:
                        raise UsageError(
                            msg + ' (set "strict": False in the lr_scheduler dict to skip instead)'
                        )
                    rank_zero_warn(msg + ": skipping this update")
                    continue
            trainer.hooks.module("lr_scheduler_step", cfg.scheduler, metric)
