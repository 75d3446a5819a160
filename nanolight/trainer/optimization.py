"""The trainer's optimization duties, for both kinds of optimization: backward with its hooks,
the optimizer step behind ``NanoOptimizer.step``, clipping, and the LR schedulers.

Automatic optimization (`step.py`) steps once per accumulation window through the module's
``optimizer_step``; manual optimization (`manual.py`) lets ``training_step`` call ``opt.step()``.
Either way `global_step` counts optimizer steps, as in Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from nanolight.errors import UsageError
from nanolight.module.optimizers import NanoOptimizer, parse_optimizers
from nanolight.trainer.builders import check_manual

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer


class Optimization:
    """Mixed into `NanoTrainer`."""

    def setup_optimization(self: NanoTrainer, module: Any) -> None:
        """``configure_optimizers`` -> the strategy's (wrapped) optimizers, the schedulers, and the
        ``self.optimizers()`` objects, whose ``step`` goes through `_optimizer_step`."""
        check_manual(module, self.config, self.strategy)
        manual = not module.automatic_optimization
        optimizers, self.lr_scheduler_configs = parse_optimizers(self.call_module_hook("configure_optimizers"), manual)
        if module.automatic_optimization and len(optimizers) > 1:
            raise UsageError(
                f"configure_optimizers returned {len(optimizers)} optimizers: several optimizers need manual "
                "optimization (self.automatic_optimization = False, then opt1, opt2 = self.optimizers() in "
                "training_step), or one optimizer with param groups"
            )
        self.strategy.setup_optimizers(optimizers)
        zero_grad = self.strategy.zero_grad
        self.nano_optimizers = [NanoOptimizer(opt, self._optimizer_step, zero_grad) for opt in self.optimizers]

    def backward(self: NanoTrainer, loss: torch.Tensor, micro_batch: int = 0, n: int = 1) -> None:
        """on_before_backward -> the module's ``backward`` (through the strategy) -> on_after_backward."""
        self.call_hook("on_before_backward", loss)
        with self.strategy.backward_context(micro_batch, n):
            self.call_module_hook("backward", loss)
        self.call_hook("on_after_backward")

    def _optimizer_step(self: NanoTrainer, optimizer: Any, closure: Callable[[], Any] | None) -> Any:
        """``NanoOptimizer.step``. Automatic: the closure makes the gradients final and runs the
        hooks up to clipping. Manual: the gradients are finished here, then the hook runs."""
        automatic = self.lightning_module.automatic_optimization
        if automatic and closure is None:
            raise UsageError("under automatic optimization optimizer.step needs the optimizer_closure")
        result = closure() if closure is not None else None
        if not automatic:
            self.strategy.finish_backward()
            self.call_hook("on_before_optimizer_step", optimizer)
        if self.skip_optimizer_step:  # a callback (NaNGuard) vetoed this update
            self.strategy.zero_grad(optimizer)
        else:
            self.strategy.optimizer_step(optimizer)
        if not automatic:
            self.progress["global_step"] += 1
        return result

    def before_optimizer_step(self: NanoTrainer, optimizer: Any) -> None:
        """Automatic optimization, inside the closure: the hook, then the module's clipping."""
        self.skip_optimizer_step = False
        self.call_hook("on_before_optimizer_step", optimizer)
        cfg = self.config
        self.call_module_hook(
            "configure_gradient_clipping", optimizer, cfg.gradient_clip_val, cfg.gradient_clip_algorithm
        )

    def after_optimizer_step(self: NanoTrainer, last_of_epoch: bool) -> None:
        """Automatic optimization, after ``optimizer_step`` returned: count it, step the
        schedulers due (epoch ones at the epoch's last batch, as Lightning), publish the step's
        values before the last micro-batch's on_train_batch_end."""
        self.progress["global_step"] += 1
        batch_idx = self.progress["batch_idx"] - 1
        if not self.skip_optimizer_step:  # a vetoed update does not advance the schedule
            self.update_lr_schedulers("step", plateau=False, batch_idx=batch_idx)
        if last_of_epoch:
            self.update_lr_schedulers("epoch", plateau=False, batch_idx=batch_idx)
        self.publish_step(sync=True)

    def clip_gradients(self: NanoTrainer, optimizer: Any, value: float | None, algorithm: str | None) -> torch.Tensor | None:
        """Lightning's ``clip_gradients`` rules; the norm goes through the strategy (summed over
        every parallel rank), returned and kept as `grad_norm`."""
        cfg = self.config
        if value is None:
            value = cfg.gradient_clip_val or 0.0
        elif cfg.gradient_clip_val is not None and cfg.gradient_clip_val != value:
            raise UsageError(
                f"gradient_clip_val={value} passed to clip_gradients, but NanoTrainer(gradient_clip_val="
                f"{cfg.gradient_clip_val}) too: use one of them"
            )
        algorithm = (algorithm or cfg.gradient_clip_algorithm or "norm").lower()
        if algorithm not in ("norm", "value"):
            raise UsageError(f'gradient_clip_algorithm must be "norm" or "value", got {algorithm!r}')
        if value <= 0:
            return None
        if algorithm == "value":
            self.strategy.clip_gradients_value(value, optimizer)
            return None
        self.grad_norm = self.strategy.clip_gradients(value)
        return self.grad_norm

    # ---- LR schedulers -------------------------------------------------------------------
    def update_lr_schedulers(self: NanoTrainer, interval: str, plateau: bool, batch_idx: int) -> None:
        """Step the schedulers of `interval` due now (Lightning: plateau ones apart, after
        validation; a scheduler steps when its counter (batch or epoch, 1-based) hits `frequency`)."""
        if not self.lightning_module.automatic_optimization:
            return  # manual optimization steps its schedulers itself
        for cfg in self.lr_scheduler_configs:
            if cfg.reduce_on_plateau != plateau or cfg.interval != interval:
                continue
            counter = (batch_idx if interval == "step" else self.current_epoch) + 1
            if counter % cfg.frequency:
                continue
            metric = None
            if cfg.reduce_on_plateau:
                metric = self.callback_metrics.get(cfg.monitor or "")
                if metric is None:
                    msg = (
                        f"ReduceLROnPlateau watches {cfg.monitor!r}, which was not logged; logged: "
                        f"{sorted(self.callback_metrics)}"
                    )
                    if cfg.strict:
                        raise UsageError(msg + ' (set "strict": False in the lr_scheduler dict to skip instead)')
                    rank_zero_warn(msg + ": skipping this update")
                    continue
            self.call_module_hook("lr_scheduler_step", cfg.scheduler, metric)
