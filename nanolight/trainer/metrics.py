"""`MetricStore`: where ``self.log`` goes, and the trainer's metric dicts (Lightning's logger
connector).

It routes each call to the loop's `Results` (training, or the evaluation pass running), picks
Lightning's defaults for the hook it is called from (``on_step`` in training steps and batch
hooks, ``on_epoch`` elsewhere), infers the batch size for epoch means, and publishes values to
``callback_metrics`` / ``progress_bar_metrics`` / ``logged_metrics`` at the moments Lightning
does: after every batch (step values), and when an epoch ends -- before the epoch-end hooks run,
so a callback's ``on_validation_epoch_end`` sees this validation's values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from nanolight.errors import UsageError
from nanolight.trainer.results import Meta, Reduce, Results, reduce_fx_name, to_scalar_tensor

# hooks whose logs default to step values (Lightning's FxValidator); every other allowed hook
# defaults to epoch values
STEP_HOOKS = frozenset(
    {
        "training_step", "on_train_batch_start", "on_train_batch_end", "on_before_backward", "backward",
        "on_after_backward", "on_before_optimizer_step", "optimizer_step", "on_before_zero_grad",
        "optimizer_zero_grad", "configure_gradient_clipping", "lr_scheduler_step",
    }
)  # fmt: skip
NOT_LOGGABLE = frozenset(
    {
        "predict_step", "on_predict_start", "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end",
        "on_predict_batch_start", "on_predict_batch_end", "setup", "teardown", "prepare_data",
        "configure_model", "configure_optimizers", "configure_callbacks", "on_fit_start", "on_fit_end",
        "on_sanity_check_start", "on_sanity_check_end", "on_train_end", "train_dataloader",
        "val_dataloader", "test_dataloader", "predict_dataloader", "on_save_checkpoint", "on_load_checkpoint",
    }
)  # fmt: skip


def batch_size_of(batch: Any) -> int | None:
    """The first tensor's leading size in a (nested) batch, as Lightning infers it."""
    if isinstance(batch, torch.Tensor):
        return 1 if batch.dim() == 0 else int(batch.size(0))
    if isinstance(batch, str):
        return None
    items: Iterable[Any] = batch.values() if isinstance(batch, Mapping) else batch if _iterable(batch) else ()
    for item in items:
        size = batch_size_of(item)
        if size is not None:
            return size
    return None


def _iterable(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) or (hasattr(obj, "__iter__") and hasattr(obj, "__len__"))


class MetricStore:
    """The trainer's logging state; ``reduce`` is the strategy's (a collective)."""

    def __init__(self, reduce: Reduce, always_sync: bool = False) -> None:
        self.reduce = reduce
        self.always_sync = always_sync  # pipeline parallelism: only the last stage has the loss
        self.train = Results(training=True)
        self.eval = Results(training=False)
        self.active: Results | None = None
        self.hook: str | None = None  # the hook running now (sets the defaults)
        self.batch: Any = None  # the batch being processed (for its size)
        self.dataloader_idx: int | None = None  # evaluation with several dataloaders
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, torch.Tensor] = {}
        self.progress_bar_metrics: dict[str, torch.Tensor] = {}

    def log(
        self,
        name: str,
        value: Any,
        *,
        prog_bar: bool,
        logger: bool,
        on_step: bool | None,
        on_epoch: bool | None,
        reduce_fx: Any,
        sync_dist: bool,
        batch_size: int | None,
        add_dataloader_idx: bool,
    ) -> None:
        hook = self.hook or "training_step"
        if hook in NOT_LOGGABLE or self.active is None:
            raise UsageError(f"self.log({name!r}) cannot be called in {hook}: log in a step or a loop hook")
        default_step = hook in STEP_HOOKS
        on_step = default_step if on_step is None else on_step
        on_epoch = (not default_step) if on_epoch is None else on_epoch
        if not self.active.training and on_step and hook in ("on_validation_epoch_end", "on_test_epoch_end"):
            raise UsageError(f"self.log({name!r}, on_step=True) in {hook}: an epoch-end hook logs epoch values")
        if not (on_step or on_epoch):
            raise UsageError(f"self.log({name!r}, on_step=False, on_epoch=False) would record nothing")
        if self.dataloader_idx is not None and add_dataloader_idx:
            name = f"{name}/dataloader_idx_{self.dataloader_idx}"
        fx = reduce_fx_name(reduce_fx)
        meta = Meta(name, prog_bar, logger, on_step, on_epoch, fx, sync_dist or self.always_sync)
        tensor = to_scalar_tensor(name, value)
        if batch_size is None:
            batch_size = (batch_size_of(self.batch) or 1) if fx == "mean" and on_epoch else 1
        self.active.log(meta, tensor, batch_size, self.dataloader_idx)
        if on_step and self.active.training:  # seen at once by later hooks of this batch (unsynced)
            self.callback_metrics[name] = tensor
            self.callback_metrics[meta.forked(True)] = tensor
        elif on_epoch and hook in ("on_validation_epoch_end", "on_test_epoch_end"):
            self.callback_metrics[name] = tensor  # seen at once by the callbacks after this one (Lightning)

    # ---- publishing (Lightning's on_batch_end / on_epoch_end) -----------------------------
    def publish(self, results: Results, on_step: bool, update: bool = True) -> dict[str, torch.Tensor]:
        """Update callback / progress-bar / logged metrics (unless not `update`); returns the values
        for a logger row."""
        if on_step:
            results.sync_step(self.reduce)
        else:
            results.compute_epoch(self.reduce)
        log, callback, pbar = results.values(on_step, self.dataloader_idx)
        if not update:
            return log
        self.callback_metrics.update(callback)
        self.progress_bar_metrics.update(pbar)
        self.logged_metrics.update(log)
        return log

    def reset(self) -> None:
        """A new trainer call: Lightning's dicts start empty for fit, validate, test, predict."""
        self.train.reset()
        self.eval.reset()
        self.callback_metrics, self.logged_metrics, self.progress_bar_metrics = {}, {}, {}
