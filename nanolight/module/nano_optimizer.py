"""`NanoOptimizer`: what ``self.optimizers()`` returns -- the strategy's optimizer, stepped
through the trainer (Lightning's ``LightningOptimizer``).

Its ``step`` is where the trainer finishes the gradients (a parallel strategy reduces them),
fires ``on_before_optimizer_step``, and counts ``global_step``; its ``zero_grad`` goes through
the strategy (bucketed data parallelism keeps ``.grad`` as views into its buffers). Everything
else (``param_groups``, ``state``, ``state_dict``) is the wrapped optimizer's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

StepFn = Callable[[Any, Callable[[], Any] | None], Any]


class NanoOptimizer:
    """A thin, transparent wrapper: ``step`` and ``zero_grad`` are routed, the rest is delegated."""

    def __init__(self, optimizer: torch.optim.Optimizer, step_fn: StepFn, zero_grad_fn: Callable[[Any], None]):
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
