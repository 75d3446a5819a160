"""`NanoModule`: the user's base class -- an ``nn.Module`` with Lightning's hook names.

A user builds ``self.model`` in `configure_model` (called by the trainer once the strategy's
``parallel_context`` exists, inside the strategy's init context, e.g. the meta device), writes
`training_step` returning a scalar loss, and returns an optimizer (+ scheduler) from
`configure_optimizers`. Everything layout-specific is reached through ``self.trainer.strategy``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from nanolight.trainer import NanoTrainer


class NanoModule(nn.Module):
    """Base class for what `NanoTrainer` trains. Every hook below is optional except
    `training_step` and `configure_optimizers`."""

    def __init__(self) -> None:
        super().__init__()
        # stored outside nn.Module's registries: the trainer is not a submodule
        object.__setattr__(self, "_trainer", None)

    # ---- wiring ------------------------------------------------------------------------
    @property
    def trainer(self) -> NanoTrainer:
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a NanoTrainer (call trainer.fit)")
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: NanoTrainer | None) -> None:
        object.__setattr__(self, "_trainer", trainer)

    @property
    def parallel_context(self) -> Any:
        """The strategy's ParallelContext; None on a single device or before fit."""
        return None if self._trainer is None else self._trainer.strategy.parallel_context

    @property
    def device(self) -> torch.device:
        if self._trainer is not None:
            return self._trainer.strategy.root_device
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @property
    def global_step(self) -> int:
        return 0 if self._trainer is None else self._trainer.global_step

    @property
    def current_epoch(self) -> int:
        return 0 if self._trainer is None else self._trainer.current_epoch

    # ---- logging -----------------------------------------------------------------------
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        sync_dist: bool = False,
    ) -> None:
        """Record a scalar. In training: averaged over the step's micro-batches, logged per step
        (``on_step``, default) and/or as an epoch mean (``on_epoch``). In validation: averaged
        over the epoch. ``sync_dist`` averages it over data-parallel ranks (through the strategy)."""
        if self._trainer is None:
            return
        self._trainer.metrics.log(name, value, prog_bar, logger, on_step, on_epoch, sync_dist)

    def log_dict(self, metrics: dict[str, Any], **kwargs: Any) -> None:
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    # ---- user hooks (override) ---------------------------------------------------------
    def configure_model(self) -> None:
        """Build ``self.model`` (idempotent: may already exist)."""

    def configure_optimizers(self) -> Any:
        """Return an optimizer, a list of them, ``(optimizers, schedulers)``, or a dict with
        ``optimizer`` and optionally ``lr_scheduler`` (a scheduler or a dict with ``scheduler``,
        ``interval`` ("step"|"epoch"), ``frequency``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_optimizers()")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """Return the scalar loss of one micro-batch (or a dict with ``"loss"``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """Optional; log ``val/...`` metrics with ``self.log``."""

    def setup(self, stage: str) -> None: ...
    def teardown(self, stage: str) -> None: ...
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add entries to ``checkpoint`` (tensors / plain containers only)."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read what `on_save_checkpoint` added (called before the weights are loaded)."""

    def on_exception(self, exception: BaseException) -> None: ...
