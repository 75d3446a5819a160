"""`LearningRateMonitor`: Lightning 2.6's callback; logs learning rates (and optionally momentum and
weight decay) of every optimizer's param groups, straight to the loggers.

Keys, timing and values follow Lightning (see its docs); rows go to the loggers on rank zero with
``step=trainer.log_step``, and the values also land in ``trainer.callback_metrics`` (not in
``logged_metrics``). A ZeRO wrapper is read through the user's optimizer it fronts.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Literal

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from nanolight.callbacks.base import Callback
from nanolight.errors import UsageError


def _front(optimizer: Any) -> Any:
    """The ``torch.optim`` optimizer whose param groups a (ZeRO) wrapper exposes."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _class_name(optimizer: Any) -> str:
    return type(getattr(optimizer, "inner", _front(optimizer))).__name__


class LearningRateMonitor(Callback):
    """Args: ``logging_interval`` (None, "step" or "epoch"), ``log_momentum``, ``log_weight_decay``.
    ``lrs`` keeps every logged lr per key."""

    def __init__(
        self,
        logging_interval: Literal["step", "epoch"] | None = None,
        log_momentum: bool = False,
        log_weight_decay: bool = False,
    ) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise UsageError(
                f"LearningRateMonitor(logging_interval={logging_interval!r}): use 'step', 'epoch' or None"
            )
        self.logging_interval = logging_interval
        self.log_momentum, self.log_weight_decay = log_momentum, log_weight_decay
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.loggers:
            raise UsageError(
                "Cannot use `LearningRateMonitor` callback with a trainer that has no logger: pass "
                "`logger=` (e.g. CSVLogger) to NanoTrainer, or drop the callback"
            )
        if self.log_momentum:
            configs = trainer.lr_scheduler_configs
            optimizers = [c.scheduler.optimizer for c in configs] if configs else trainer.optimizers
            if any(
                "momentum" not in _front(o).defaults and "betas" not in _front(o).defaults for o in optimizers
            ):
                rank_zero_warn(
                    "You have set log_momentum=True, but some optimizers do not have momentum. This will "
                    "log a value 0 for the momentum.",
                    category=RuntimeWarning,
                )
        names = [name for group in self._named(trainer) for name in group[1]]
        self.lrs = {name: [] for name in names}
        self.last_momentum_values = {f"{name}-momentum": None for name in names}
        self.last_weight_decay_values = {f"{name}-weight_decay": None for name in names}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not trainer.should_log or self.logging_interval == "epoch":
            return
        self._log(trainer, "step" if self.logging_interval is None else "any")

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.logging_interval != "step":
            self._log(trainer, "epoch" if self.logging_interval is None else "any")

    def _log(self, trainer: Any, interval: str) -> None:
        stats: dict[str, float] = {}
        for optimizer, names, sched_interval in self._named(trainer):
            if sched_interval is None or interval in (sched_interval, "any"):
                stats.update(self._optimizer_stats(optimizer, names))
        device = trainer.strategy.root_device
        trainer.callback_metrics.update({k: torch.tensor(v, device=device) for k, v in stats.items()})
        if stats and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(stats, step=trainer.log_step)

    def _named(self, trainer: Any) -> list[tuple[Any, list[str], str | None]]:
        """(optimizer, one key per param group, its scheduler's interval or None), scheduled first."""
        out: list[tuple[Any, list[str], str | None]] = []
        seen: list[Any] = []
        seen_types: defaultdict[type, int] = defaultdict(int)
        for config in trainer.lr_scheduler_configs:
            opt = _front(config.scheduler.optimizer)
            base = config.name if config.name is not None else f"lr-{_class_name(config.scheduler.optimizer)}"
            names = self._group_names(opt, base, seen, seen_types, counted=config.name is None)
            out.append((opt, names, config.interval))
        for optimizer in trainer.optimizers:
            opt = _front(optimizer)
            if any(opt is s for s in seen):
                continue
            names = self._group_names(opt, f"lr-{_class_name(optimizer)}", seen, seen_types, counted=True)
            out.append((opt, names, None))
        return out

    @staticmethod
    def _group_names(
        opt: Any, base: str, seen: list[Any], seen_types: defaultdict[type, int], counted: bool
    ) -> list[str]:
        seen.append(opt)
        if counted:
            seen_types[type(opt)] += 1
        groups = opt.param_groups
        group_names = [g.get("name", f"pg{i}") for i, g in enumerate(groups, start=1)]
        duplicates = {n for n in group_names if group_names.count(n) > 1}
        if duplicates:
            raise UsageError(
                "A single optimizer cannot have several parameter groups with the same `name`: "
                f"{base} has duplicated parameter group names {sorted(duplicates)}; give each group its own"
            )
        count = seen_types.get(type(opt), 0)
        if count > 1:
            base = f"{base}-{count - 1}"
        if len(groups) > 1:
            return [f"{base}/{g.get('name', f'pg{i}')}" for i, g in enumerate(groups, start=1)]
        name = groups[0].get("name") if groups else None
        return [f"{base}/{name}" if name else base for _ in groups]

    def _optimizer_stats(self, opt: Any, names: list[str]) -> dict[str, float]:
        stats: dict[str, float] = {}
        use_betas = "betas" in opt.defaults
        for group, name in zip(opt.param_groups, names, strict=True):
            stats[name] = group["lr"]
            self.lrs.setdefault(name, []).append(group["lr"])
            if self.log_momentum:
                momentum = group["betas"][0] if use_betas else group.get("momentum", 0)
                stats[f"{name}-momentum"] = self.last_momentum_values[f"{name}-momentum"] = momentum
            if self.log_weight_decay:
                decay = group["weight_decay"]
                stats[f"{name}-weight_decay"] = self.last_weight_decay_values[f"{name}-weight_decay"] = decay
        return stats
