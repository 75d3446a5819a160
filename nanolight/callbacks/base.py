"""`Callback`: Lightning's hook names and arguments. Callbacks run before the module's hook of
the same name, in the order given to the trainer (checkpointing callbacks are moved last; at a
train epoch's end ModelCheckpoint and EarlyStopping run after the module).

`info` is where the callbacks' ``verbose`` messages go: the ``nanolight`` logger, shown on stderr.
Lightning prints them through a logger with its own stream handler, so ``verbose=True`` is visible
without configuring logging; nanolight's get the same (a handler is added only when the
application has not configured the ``nanolight`` logger itself).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nanolight.module import NanoModule
    from nanolight.trainer import NanoTrainer

log = logging.getLogger("nanolight")
if not log.handlers:
    log.addHandler(logging.StreamHandler())
    log.setLevel(logging.INFO)
    log.propagate = False


def info(message: str, rank: int | None = None, rank_zero_only: bool = True) -> None:
    """Log `message` (prefixed with ``[rank: r]`` when `rank` is given). With `rank_zero_only`,
    ranks other than 0 stay silent."""
    if rank_zero_only and rank not in (None, 0):
        return
    log.info(f"[rank: {rank}] {message}" if rank is not None else message)


class Callback:
    """Override any subset of the hooks. ``state_dict`` is saved in checkpoints under `state_key`."""

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint; override when several instances coexist."""
        return type(self).__qualname__

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def setup(self, trainer: NanoTrainer, pl_module: NanoModule, stage: str) -> None: ...
    def teardown(self, trainer: NanoTrainer, pl_module: NanoModule, stage: str) -> None: ...
    def on_fit_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_fit_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_sanity_check_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_sanity_check_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_train_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_train_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_validation_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_validation_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_test_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_test_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_predict_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_predict_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_train_epoch_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_train_epoch_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_validation_epoch_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_validation_epoch_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_test_epoch_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_test_epoch_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_predict_epoch_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_predict_epoch_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_train_batch_start(
        self, trainer: NanoTrainer, pl_module: NanoModule, batch: Any, batch_idx: int
    ) -> None: ...
    def on_train_batch_end(
        self, trainer: NanoTrainer, pl_module: NanoModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...
    def on_validation_batch_start(
        self, trainer: NanoTrainer, pl_module: NanoModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_validation_batch_end(
        self,
        trainer: NanoTrainer,
        pl_module: NanoModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_test_batch_start(
        self, trainer: NanoTrainer, pl_module: NanoModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_test_batch_end(
        self,
        trainer: NanoTrainer,
        pl_module: NanoModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_predict_batch_start(
        self, trainer: NanoTrainer, pl_module: NanoModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_predict_batch_end(
        self,
        trainer: NanoTrainer,
        pl_module: NanoModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_before_backward(self, trainer: NanoTrainer, pl_module: NanoModule, loss: torch.Tensor) -> None: ...
    def on_after_backward(self, trainer: NanoTrainer, pl_module: NanoModule) -> None: ...
    def on_before_optimizer_step(
        self, trainer: NanoTrainer, pl_module: NanoModule, optimizer: torch.optim.Optimizer
    ) -> None: ...
    def on_before_zero_grad(
        self, trainer: NanoTrainer, pl_module: NanoModule, optimizer: torch.optim.Optimizer
    ) -> None: ...
    def on_save_checkpoint(
        self, trainer: NanoTrainer, pl_module: NanoModule, checkpoint: dict[str, Any]
    ) -> None: ...
    def on_load_checkpoint(
        self, trainer: NanoTrainer, pl_module: NanoModule, checkpoint: dict[str, Any]
    ) -> None: ...
    def on_exception(self, trainer: NanoTrainer, pl_module: NanoModule, exception: BaseException) -> None: ...
