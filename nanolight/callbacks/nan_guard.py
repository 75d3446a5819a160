"""`NaNGuard`: never apply an update computed from a non-finite loss or gradient; `DivergenceCheck`:
end a diverged run without a host sync per step, and never save its non-finite state.

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

from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from nanolight.callbacks.base import Callback
from nanolight.checkpoint.atomic import LAST_POINTER, resolve_checkpoint
from nanolight.errors import TrainingDiverged


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


class DivergenceCheck(Callback):
    """Ends a diverged run with `TrainingDiverged`, and never lets it save a non-finite checkpoint.

    Why not `NaNGuard`: its decision before each update costs a host sync per step. This check
    only records, on the device, the first step whose loss or global grad norm is not finite (a
    few device ops, no read), and reads that record where the step reads values back anyway: on
    logging steps, right before every checkpoint save (which also checks the weights: an update
    that overflowed them shows in no loss yet) and at the end. So a diverged run stops at its next
    logging step or save, and rotation cannot delete the newest finite checkpoint: nothing
    non-finite is ever written. The error names the first non-finite step and the last checkpoint
    (all of them finite) to resume from.
    """

    def __init__(self, check_grads: bool = True) -> None:
        self.check_grads = check_grads
        self._first_bad: torch.Tensor | None = None  # on the device: the first non-finite step, or -1
        self._seen_step = -1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._first_bad, self._seen_step = None, trainer.global_step

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if optimizer is not trainer.optimizers[0] or trainer.skip_optimizer_step:
            return
        loss = trainer.step_loss
        norm = trainer.strategy.clip_gradients(None) if self.check_grads else None  # the step's one norm
        checked = [v.detach().float().reshape(()) for v in (loss, norm) if v is not None]
        if not checked:
            return
        bad = ~torch.isfinite(torch.stack(checked)).all()  # stays on the device: no read here
        first = self._first_bad
        if first is None:
            first = torch.full((), -1, dtype=torch.long, device=bad.device)
        step = torch.full_like(first, trainer.global_step + 1)  # the step being taken
        self._first_bad = torch.where(bad & (first < 0), step, first)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._seen_step:  # not a step's last micro-batch
            return
        self._seen_step = trainer.global_step
        if trainer.should_log:  # the step reads its metrics back anyway
            self._check(trainer, pl_module, saving=False)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == "fit":
            self._check(trainer, pl_module, saving=True)  # before anything of the save is written

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._check(trainer, pl_module, saving=False)

    def _check(self, trainer: Any, pl_module: Any, saving: bool) -> None:
        """Every rank: read the record (and, before a save, whether the weights are finite), agree."""
        first = int(self._first_bad) if self._first_bad is not None else -1  # the one read
        weights_bad = saving and not _finite(pl_module)
        strategy = trainer.strategy
        # every rank sends its first non-finite step (+1: 0 is none); the largest is the one all have seen
        first = strategy.agree_max(first + 1).wait() - 1
        weights_bad = bool(strategy.agree_max(int(weights_bad)).wait())  # any rank's flag (a save only)
        if first < 0 and not weights_bad:
            return
        what = (
            f"the loss or gradient norm is not finite from step {first}"
            if first >= 0
            else f"the weights are not finite after step {trainer.global_step}"
        )
        cb = trainer.checkpoint_callback  # `last` moves only after a save is complete: finite ones
        last = resolve_checkpoint(Path(cb.dirpath) / LAST_POINTER) if cb is not None and cb.dirpath else None
        good = f"the last finite checkpoint is {last}" if last else "no finite checkpoint was saved"
        raise TrainingDiverged(
            f"training diverged: {what} (stopped at step {trainer.global_step}, nothing saved after "
            f"it); {good}: resume from it with a lower learning rate or a longer warm-up (ckpt_path='last'; "
            "the recipe: checkpoint.resume=last optim.lr=...)"
        )


def _finite(module: Any) -> bool:
    """Whether this rank's weights are all finite (one read, at a save)."""
    flags = [torch.isfinite(p.detach()).all() for p in module.parameters()]
    return bool(torch.stack(flags).all()) if flags else True
