"""The optimizers a module sees: what ``configure_optimizers`` may return (Lightning's forms),
normalised into optimizers + schedulers (`parse_optimizers`), and what ``self.optimizers()`` returns.

`NanoOptimizer`: what ``self.optimizers()`` returns -- the strategy's optimizer, stepped
through the trainer (Lightning's ``LightningOptimizer``).

Its ``step`` is where the trainer finishes the gradients (a parallel strategy reduces them),
fires ``on_before_optimizer_step``, and counts ``global_step``; its ``zero_grad`` goes through
the strategy (bucketed data parallelism keeps ``.grad`` as views into its buffers). Everything
else (``param_groups``, ``state``, ``state_dict``) is the wrapped optimizer's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from lightning_utilities.core.overrides import is_overridden
from lightning_utilities.core.rank_zero import rank_zero_warn

_FORMS = (
    "an Optimizer; a list/tuple of Optimizers; ([optimizers], [schedulers]); "
    '{"optimizer": opt, "lr_scheduler": sched or {"scheduler": sched, "interval": "step"|"epoch", '
    '"frequency": n}}; or a list of such dicts'
)


@dataclass
class SchedulerConfig:
    """One LR scheduler and when to step it (Lightning's defaults: every 1 epoch)."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    name: str | None = None
    strict: bool = True  # a plateau scheduler whose metric is missing: an error (False: a warning)
    # stepped with a monitored metric, after validation (default: a torch ReduceLROnPlateau)
    reduce_on_plateau: bool | None = None

    def __post_init__(self) -> None:
        if self.reduce_on_plateau is None:
            self.reduce_on_plateau = isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if self.interval not in ("step", "epoch"):
            raise ValueError(f'lr_scheduler "interval" must be "step" or "epoch", got {self.interval!r}')
        if not isinstance(self.frequency, int) or self.frequency < 1:
            raise ValueError(f'lr_scheduler "frequency" must be a positive int, got {self.frequency!r}')
        if not (hasattr(self.scheduler, "state_dict") and hasattr(self.scheduler, "load_state_dict")):
            raise TypeError(
                f"lr_scheduler {type(self.scheduler).__name__} needs state_dict() and load_state_dict() "
                "(checkpoints save it)"
            )


_CONFIG_KEYS = {f.name for f in fields(SchedulerConfig)}
_MANUAL_IGNORED = ("monitor", "strict", "reduce_on_plateau")  # manual optimization steps by hand


def _bad(got: Any, why: str) -> TypeError:
    return TypeError(f"configure_optimizers() returned {type(got).__name__}: {why}. Expected {_FORMS}.")


def _scheduler(obj: Any, where: Any, monitor: str | None, manual: bool) -> SchedulerConfig:
    """One scheduler (or its dict) as a config. Keys Lightning does not know are dropped with a
    warning, as are, under manual optimization, those only automatic stepping uses."""
    if not isinstance(obj, dict):
        return SchedulerConfig(obj, monitor=None if manual else monitor)
    if "scheduler" not in obj:
        raise _bad(where, f'the lr_scheduler dict has no "scheduler" key (keys: {sorted(obj)})')
    unknown = sorted(set(obj) - _CONFIG_KEYS)
    if unknown:
        rank_zero_warn(
            f"unsupported keys in the lr_scheduler dict are ignored: {unknown}", category=RuntimeWarning
        )
    ignored = [k for k in _MANUAL_IGNORED if k in obj] if manual else []
    if ignored:
        rank_zero_warn(
            f"the lr_scheduler dict's {ignored} are ignored under manual optimization: step the scheduler "
            "yourself (self.lr_schedulers().step(...))",
            category=RuntimeWarning,
        )
    kept = {k: v for k, v in obj.items() if k in _CONFIG_KEYS and k not in ignored}
    config = SchedulerConfig(**{"monitor": None if manual else monitor, **kept})
    if isinstance(config.scheduler, torch.optim.lr_scheduler.OneCycleLR) and config.interval == "epoch":
        rank_zero_warn(
            'a OneCycleLR scheduler with "interval": "epoch" (did you mean "interval": "step"?)',
            category=RuntimeWarning,
        )
    return config


def _from_dict(d: dict, where: Any, manual: bool) -> tuple[torch.optim.Optimizer, list[SchedulerConfig]]:
    if "optimizer" not in d:
        raise _bad(where, f'the dict has no "optimizer" key (keys: {sorted(d)})')
    unknown = sorted(set(d) - {"optimizer", "lr_scheduler", "monitor"})
    if unknown:
        rank_zero_warn(
            f"unsupported keys in the optimizer dict are ignored: {unknown}", category=RuntimeWarning
        )
    opt = d["optimizer"]
    if not isinstance(opt, torch.optim.Optimizer):
        raise _bad(where, f'"optimizer" is a {type(opt).__name__}, not a torch.optim.Optimizer')
    scheds = []
    if d.get("lr_scheduler") is not None:
        scheds.append(_scheduler(d["lr_scheduler"], where, d.get("monitor"), manual))
    return opt, scheds


def parse_optimizers(
    out: Any, manual: bool = False
) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """Return (optimizers, schedulers) or raise a TypeError that lists the accepted forms. Under
    manual optimization the program steps its schedulers itself, so a ReduceLROnPlateau needs no
    ``monitor`` (Lightning); automatic optimization steps it with the monitored metric."""
    if out is None:  # Lightning trains without one (its no-op optimizer), and says so
        rank_zero_warn(
            "configure_optimizers returned None (did you forget `return`?): training runs with no "
            "optimizer, nothing updates"
        )
        return [NoOptimizer()], []
    optimizers, schedulers = _parse(out, manual)
    if not manual and any(cfg.reduce_on_plateau and cfg.monitor is None for cfg in schedulers):
        raise _bad(
            out, 'a ReduceLROnPlateau scheduler needs the metric it watches: add "monitor": "val_loss"'
        )
    for cfg in schedulers:
        owner = getattr(cfg.scheduler, "optimizer", None)
        if owner is not None and not any(owner is opt for opt in optimizers):
            raise _bad(out, f"a {type(cfg.scheduler).__name__} steps an optimizer that was not returned")
    return optimizers, schedulers


def check_scheduler_api(schedulers: list[SchedulerConfig], module: Any, base: type) -> None:
    """Under automatic optimization the trainer steps each scheduler with torch's API
    (``step()`` / ``step(metric)``); another scheduler needs the module's ``lr_scheduler_step``."""
    torch_kinds = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if not module.automatic_optimization or is_overridden("lr_scheduler_step", module, base):
        return
    for cfg in schedulers:
        if not isinstance(cfg.scheduler, torch_kinds):
            raise TypeError(
                f"lr_scheduler {type(cfg.scheduler).__name__} does not follow torch's LRScheduler API: "
                "override the module's lr_scheduler_step(scheduler, metric) to step it"
            )


class NoOptimizer(torch.optim.Optimizer):
    """What a module without optimizers trains with (Lightning's): steps run the closure, update nothing."""

    def __init__(self) -> None:
        super().__init__([torch.zeros(1)], {"lr": 0.0})

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _parse(out: Any, manual: bool) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    if isinstance(out, torch.optim.Optimizer):
        return [out], []
    if isinstance(out, dict):
        opt, scheds = _from_dict(out, out, manual)
        return [opt], scheds
    if isinstance(out, (list, tuple)):
        if (
            len(out) == 2
            and isinstance(out[0], (list, tuple))
            and not isinstance(out[1], dict | torch.optim.Optimizer)
        ):
            opts, raw = out  # ([optimizers], [schedulers]) or ([optimizers], scheduler)
            if not all(isinstance(o, torch.optim.Optimizer) for o in opts) or not opts:
                raise _bad(out, "the first list must hold torch.optim.Optimizer objects")
            raw = raw if isinstance(raw, (list, tuple)) else [raw]
            return list(opts), [_scheduler(s, out, None, manual) for s in raw]
        if out and all(isinstance(x, torch.optim.Optimizer) for x in out):
            return list(out), []
        if out and all(isinstance(x, dict) for x in out):
            pairs = [_from_dict(d, out, manual) for d in out]
            return [p[0] for p in pairs], [s for p in pairs for s in p[1]]
        kinds = sorted({type(x).__name__ for x in out}) or ["<empty>"]
        raise _bad(out, f"a sequence of {kinds}")
    raise _bad(out, "not an optimizer")


StepFn = Callable[[Any, Callable[[], Any] | None], Any]


class NanoOptimizer:
    """A thin, transparent wrapper: ``step`` and ``zero_grad`` are routed, the rest is delegated."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, step_fn: StepFn, zero_grad_fn: Callable[[Any], None]
    ):
        self._optimizer = optimizer
        self._step_fn, self._zero_grad_fn = step_fn, zero_grad_fn

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer from ``configure_optimizers`` as the strategy wrapped it (e.g. ZeRO-1)."""
        return self._optimizer

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run `closure` (if any), then the update, through the trainer."""
        if kwargs:
            raise TypeError(f"NanoOptimizer.step takes only a closure, got {sorted(kwargs)}")
        return self._step_fn(self._optimizer, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_grad_fn(self._optimizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def __repr__(self) -> str:
        return f"NanoOptimizer({self._optimizer!r})"
