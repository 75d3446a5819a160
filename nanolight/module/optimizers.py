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
from dataclasses import dataclass
from typing import Any

import torch

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

    @property
    def reduce_on_plateau(self) -> bool:
        """Stepped with a monitored metric, after validation (Lightning's distinction)."""
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def __post_init__(self) -> None:
        if self.interval not in ("step", "epoch"):
            raise ValueError(f'lr_scheduler "interval" must be "step" or "epoch", got {self.interval!r}')
        if not isinstance(self.frequency, int) or self.frequency < 1:
            raise ValueError(f'lr_scheduler "frequency" must be a positive int, got {self.frequency!r}')
        if not hasattr(self.scheduler, "step") or not hasattr(self.scheduler, "state_dict"):
            raise TypeError(
                f"lr_scheduler must be a torch LR scheduler (with step/state_dict), got "
                f"{type(self.scheduler).__name__}"
            )


def _bad(got: Any, why: str) -> TypeError:
    return TypeError(f"configure_optimizers() returned {type(got).__name__}: {why}. Expected {_FORMS}.")


def _scheduler(obj: Any, where: Any, monitor: str | None = None) -> SchedulerConfig:
    if isinstance(obj, dict):
        if "scheduler" not in obj:
            raise _bad(where, f'the lr_scheduler dict has no "scheduler" key (keys: {sorted(obj)})')
        unknown = set(obj) - {"scheduler", "interval", "frequency", "monitor", "name", "strict"}
        if unknown:
            raise _bad(where, f"unknown lr_scheduler keys {sorted(unknown)}")
        return SchedulerConfig(**{"monitor": monitor, **obj})
    return SchedulerConfig(obj, monitor=monitor)


def _from_dict(d: dict, where: Any) -> tuple[torch.optim.Optimizer, list[SchedulerConfig]]:
    if "optimizer" not in d:
        raise _bad(where, f'the dict has no "optimizer" key (keys: {sorted(d)})')
    unknown = set(d) - {"optimizer", "lr_scheduler", "monitor"}
    if unknown:
        raise _bad(where, f"unknown keys {sorted(unknown)}")
    opt = d["optimizer"]
    if not isinstance(opt, torch.optim.Optimizer):
        raise _bad(where, f'"optimizer" is a {type(opt).__name__}, not a torch.optim.Optimizer')
    scheds = []
    if d.get("lr_scheduler") is not None:
        scheds.append(_scheduler(d["lr_scheduler"], where, d.get("monitor")))
    return opt, scheds


def parse_optimizers(
    out: Any, manual: bool = False
) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """Return (optimizers, schedulers) or raise a TypeError that lists the accepted forms. Under
    manual optimization the program steps its schedulers itself, so a ReduceLROnPlateau needs no
    ``monitor`` (Lightning); automatic optimization steps it with the monitored metric."""
    optimizers, schedulers = _parse(out)
    if not manual and any(cfg.reduce_on_plateau and cfg.monitor is None for cfg in schedulers):
        raise _bad(
            out, 'a ReduceLROnPlateau scheduler needs the metric it watches: add "monitor": "val_loss"'
        )
    return optimizers, schedulers


def _parse(out: Any) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    if out is None:
        raise _bad(out, "nothing was returned (did you forget `return`?)")
    if isinstance(out, torch.optim.Optimizer):
        return [out], []
    if isinstance(out, dict):
        opt, scheds = _from_dict(out, out)
        return [opt], scheds
    if isinstance(out, (list, tuple)):
        if len(out) == 2 and all(isinstance(x, (list, tuple)) for x in out):
            opts, raw = out
            if not all(isinstance(o, torch.optim.Optimizer) for o in opts) or not opts:
                raise _bad(out, "the first list must hold torch.optim.Optimizer objects")
            return list(opts), [_scheduler(s, out) for s in raw]
        if out and all(isinstance(x, torch.optim.Optimizer) for x in out):
            return list(out), []
        if out and all(isinstance(x, dict) for x in out):
            pairs = [_from_dict(d, out) for d in out]
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
