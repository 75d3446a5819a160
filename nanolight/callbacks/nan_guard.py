"""`NaNGuard`: never apply an update computed from a non-finite loss or gradient.

The price, and why it is paid every step: skipping an update is the host's decision (the
optimizer and scheduler step are not called), so the host must know *before* the update whether
this step's values are finite -- one host sync per step, of one device bool (the loss and the
grad norm checked together on the device). A check on logging steps only would be free on the
others but would let a non-finite update through to the weights, which no later skip repairs;
a device-side skip would need a copy of the weights and optimizer state to restore. So the guard
is opt-in (the recipe does not install it) and its one read per step is the whole cost; the
values themselves are read only on a bad step, for the warning.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from nanolight.callbacks.base import Callback


class NaNGuard(Callback):
    """Checks the step's loss (and, with ``check_grads``, the global grad norm -- the step's one
    norm: the strategy measures it here and gradient clipping reuses it) before the optimizer step.

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
        loss = trainer.step_loss
        norm = trainer.strategy.clip_gradients(None) if self.check_grads else None  # same on every rank
        checked = [v.detach().float().reshape(()) for v in (loss, norm) if v is not None]
        if not checked or bool(torch.isfinite(torch.stack(checked)).all()):  # the one host sync
            return
        if loss is not None and not torch.isfinite(loss):  # a bad step: read the values to name them
            bad = f"train/loss={float(loss)}"
        else:
            bad = f"grad_norm={float(norm)}"
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
