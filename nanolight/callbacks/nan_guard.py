"""`NaNGuard`: never apply an update computed from a non-finite loss or gradient."""

from __future__ import annotations

import math
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from nanolight.callbacks.base import Callback


class NaNGuard(Callback):
    """Checks the step's loss (and, with ``check_grads``, the global grad norm -- one extra norm
    computation through the strategy) before the optimizer step.

    ``action="skip"``: zero the gradients and skip the optimizer and scheduler step (the batch
    is consumed); after ``max_skips`` skips it stops. ``action="stop"``: skip and stop training.
    The warning names the step and the metric.
    """

    def __init__(self, action: str = "skip", check_grads: bool = True, max_skips: int | None = None) -> None:
        if action not in ("skip", "stop"):
            raise ValueError(f"NaNGuard action must be 'skip' or 'stop', got {action!r}")
        self.action, self.check_grads, self.max_skips = action, check_grads, max_skips
        self.skipped_steps: list[int] = []
        self.stopped_reason: str | None = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if optimizer is not trainer.optimizers[0] or trainer.skip_optimizer_step:
            return
        step = trainer.global_step + 1  # the step being taken (global_step counts finished ones)
        bad: str | None = None
        loss = float(trainer.step_loss) if trainer.step_loss is not None else 0.0
        if not math.isfinite(loss):
            bad = f"train/loss={loss}"
        elif self.check_grads:
            norm = float(trainer.strategy.clip_gradients(None))
            if not math.isfinite(norm):
                bad = f"grad_norm={norm}"
        if bad is None:
            return
        trainer.skip_optimizer_step = True
        self.skipped_steps.append(step)
        stop = self.action == "stop" or (
            self.max_skips is not None and len(self.skipped_steps) > self.max_skips
        )
        if stop:
            trainer.should_stop = True
            self.stopped_reason = f"non-finite {bad} at step {step}"
        what = "skipping the optimizer step and stopping" if stop else "skipping the optimizer step"
        rank_zero_warn(f"NaNGuard: non-finite {bad} at step {step}: {what}.")

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": list(self.skipped_steps)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = list(state_dict.get("skipped_steps", []))
