"""The hooks a `NanoModule` may override, with Lightning's names, arguments and defaults.

The trainer calls only the hooks a module overrides (plus the few defaults below that do work:
moving a batch, zeroing and stepping an optimizer, stepping a scheduler, backward, clipping,
switching eval/train around evaluation). `nanolight/trainer/` says when each one runs.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection


class DataHooks:
    """Where a module's data comes from, and how a batch reaches the device."""

    prepare_data_per_node: bool = True

    def prepare_data(self) -> None:
        """Download / write data once (per node: local rank 0), before `setup`; no state here."""

    def setup(self, stage: str) -> None:
        """Build what needs the data or the process group; `stage` is fit/validate/test/predict."""

    def teardown(self, stage: str) -> None: ...

    def train_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.train_dataloader is not implemented")

    def val_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.val_dataloader is not implemented")

    def test_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.test_dataloader is not implemented")

    def predict_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.predict_dataloader is not implemented")

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if device.type == "cpu":
            return batch
        return apply_to_collection(batch, torch.Tensor, lambda t: t.to(device, non_blocking=True))

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch


class ModelHooks:
    """Loop hooks (no-ops unless overridden) and the optimization defaults."""

    def configure_model(self) -> None:
        """Build ``self.model`` here (idempotent: the trainer calls it at every fit/validate/...),
        inside the strategy's init context (the meta device under tensor/pipeline parallelism)."""

    def configure_callbacks(self) -> Any:
        """Callbacks this module needs; they replace trainer callbacks of the same type."""
        return []

    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """Return -1 to end the epoch here (this batch is not trained)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_validation_model_zero_grad(self) -> None:
        """Before a validation inside fit: free the finished step's gradients."""
        self.zero_grad()  # type: ignore[attr-defined]  (torch's default: set to None)

    def on_validation_model_eval(self) -> None:
        self.eval()  # type: ignore[attr-defined]

    def on_validation_model_train(self) -> None:
        self.train()  # type: ignore[attr-defined]

    def on_test_model_eval(self) -> None:
        self.eval()  # type: ignore[attr-defined]

    def on_test_model_train(self) -> None:
        self.train()  # type: ignore[attr-defined]

    def on_predict_model_eval(self) -> None:
        self.eval()  # type: ignore[attr-defined]

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate `loss` through the strategy (under pipeline parallelism it exchanges
        gradients with the neighbouring stages, so call ``super().backward`` when overriding)."""
        self.trainer.strategy.backward(loss, *args, **kwargs)  # type: ignore[attr-defined]

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        """Step `optimizer`; the closure runs this step's last training_step, its backward, and
        the hooks up to clipping (an override must call it, e.g. via ``optimizer.step(closure=...)``)."""
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad()

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Step one scheduler; `metric` is the monitored value for ReduceLROnPlateau, else None."""
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    def configure_gradient_clipping(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Called before every optimizer step with the trainer's clipping settings."""
        self.clip_gradients(  # type: ignore[attr-defined]  (by keyword, as Lightning: overrides may rename)
            optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
        )


class CheckpointHooks:
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add entries to `checkpoint` (tensors / plain containers only)."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read what `on_save_checkpoint` added (called before callbacks restore their state)."""
