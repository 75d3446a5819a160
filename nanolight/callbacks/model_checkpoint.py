"""`ModelCheckpoint`: Lightning 2.6's checkpoint callback, writing nanolight checkpoint directories.

Arguments, defaults, triggers, top-k selection, names and state follow Lightning's
``ModelCheckpoint`` (see its docs); the differences are nanolight's checkpoint format:

* a checkpoint is a directory named by the template (``epoch=6-val_loss=0.682``, no ``.ckpt``);
* every save moves the ``<dirpath>/last`` pointer to it (the trainer does that), so ``save_last``
  does not write a copy: it makes sure the newest state is saved whenever Lightning would refresh
  ``last.ckpt`` (saving this step under its own name if top-k did not keep it, and dropping the
  previous such last-only directory); ``last_model_path`` is ``<dirpath>/last``.
  ``save_last="link"`` behaves as True (the pointer already is a link). The directory ``last``
  names is never deleted;
* ``/`` in a formatted name becomes ``_`` (see `checkpoint_names`);
* two extras: ``keep_last_n`` keeps the newest N saves in addition to the top-k ones, and
  ``save_on_train_end`` saves the step training ends at when it was not saved yet;
* the step training starts from (0, or the step resumed from) is never saved again.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor

from nanolight.callbacks import checkpoint_files as files
from nanolight.callbacks.base import Callback
from nanolight.callbacks.checkpoint_topk import TopKMixin
from nanolight.callbacks.messages import info
from nanolight.checkpoint.atomic import LAST_POINTER, remove_stale
from nanolight.errors import UsageError


class ModelCheckpoint(TopKMixin, Callback):
    """Save checkpoints during ``fit``; see the module docstring and Lightning's documentation."""

    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = LAST_POINTER
    FILE_EXTENSION = ""
    STARTING_VERSION = 1

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | Literal["link"] | None = None,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        *,
        keep_last_n: int | None = None,
        save_on_train_end: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise UsageError(f"ModelCheckpoint(mode={mode!r}): mode can be 'min' or 'max'")
        if save_last not in (None, True, False, "link"):
            raise UsageError(f"ModelCheckpoint(save_last={save_last!r}): use None, True, False or 'link'")
        if keep_last_n is not None and keep_last_n < 1:
            raise UsageError(f"ModelCheckpoint(keep_last_n={keep_last_n}): use an int >= 1, or None")
        self.monitor, self.verbose, self.mode = monitor, verbose, mode
        self.save_last, self.save_top_k = save_last, save_top_k
        self.save_on_exception, self.save_weights_only = save_on_exception, save_weights_only
        self.auto_insert_metric_name = auto_insert_metric_name
        self.keep_last_n, self.save_on_train_end = keep_last_n, save_on_train_end
        self._save_on_train_epoch_end = save_on_train_epoch_end
        self._enable_version_counter = enable_version_counter
        self.dirpath: str | None = os.path.realpath(os.path.expanduser(dirpath)) if dirpath else None
        self.filename = filename
        self._last_global_step_saved = 0  # no need to save when no steps were taken
        self._last_time_checked: float | None = None
        self._last_checkpoint_saved = ""
        self._defer_save_until_validation = False
        self._val_has_run = False  # a (non-sanity) validation ran in this fit
        self._warned: set[str] = set()
        self.current_score: Tensor | None = None
        self.best_k_models: dict[str, Tensor] = {}
        self.kth_best_model_path = ""
        self.kth_value: Tensor = torch.tensor(torch.inf if mode == "min" else -torch.inf)
        self.best_model_score: Tensor | None = None
        self.best_model_path = ""
        self.last_model_path = ""
        self._saved: dict[str, bool] = {}  # this callback's checkpoints on disk (oldest first): by top-k?
        self._last_only = ""  # the newest state saved only because of save_last
        self._init_triggers(every_n_train_steps, every_n_epochs, train_time_interval)
        self._validate_configuration()

    def _init_triggers(self, steps: int | None, epochs: int | None, interval: timedelta | None) -> None:
        if steps is None and epochs is None and interval is None:
            epochs, steps = 1, 0  # default: once per epoch (after its validation)
        self._every_n_train_steps: int = steps or 0
        self._every_n_epochs: int = epochs or 0
        self._train_time_interval = interval

    def _validate_configuration(self) -> None:
        if self.save_top_k < -1:
            raise UsageError(f"ModelCheckpoint(save_top_k={self.save_top_k}): must be >= -1")
        for name in ("every_n_train_steps", "every_n_epochs"):
            if getattr(self, f"_{name}") < 0:
                raise UsageError(f"ModelCheckpoint({name}={getattr(self, f'_{name}')}): must be >= 0")
        triggers = (self._every_n_train_steps >= 1) + (self._every_n_epochs >= 1)
        if triggers + (self._train_time_interval is not None) > 1:
            raise UsageError(
                f"ModelCheckpoint: every_n_train_steps={self._every_n_train_steps}, every_n_epochs="
                f"{self._every_n_epochs} and train_time_interval={self._train_time_interval} are mutually "
                "exclusive; set only one of them"
            )
        if self.monitor is None and self.save_top_k not in (-1, 0, 1):
            raise UsageError(
                f"ModelCheckpoint(save_top_k={self.save_top_k}, monitor=None) is not a valid configuration: "
                "no quantity to rank the top k by; pass `monitor=` or use save_top_k in (-1, 0, 1)"
            )

    @property
    def every_n_epochs(self) -> int:
        return self._every_n_epochs

    @property
    def state_key(self) -> str:
        key = {
            "monitor": self.monitor,
            "mode": self.mode,
            "every_n_train_steps": self._every_n_train_steps,
            "every_n_epochs": self._every_n_epochs,
            "train_time_interval": self._train_time_interval,
        }
        return f"{type(self).__qualname__}{key!r}"

    # ----------------------------------------------------------------------------------- hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.dirpath = trainer.strategy.broadcast(self.dirpath or files.default_dirpath(trainer), src=0)
        if stage != "fit":
            return
        self._val_has_run = False
        trainer.strategy.check_shared_directory(self.dirpath)  # every rank writes here
        if trainer.is_global_zero and os.path.isdir(self.dirpath):
            remove_stale(self.dirpath)  # temporaries of saves that were killed
            if self.save_top_k != 0 and os.listdir(self.dirpath):
                rank_zero_warn(f"Checkpoint directory {self.dirpath} exists and is not empty.")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._last_time_checked = time.monotonic()
        self._last_global_step_saved = max(self._last_global_step_saved, trainer.global_step)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        skip_state = self._should_skip_saving_checkpoint(trainer)
        n = self._every_n_train_steps
        skip_batch = n < 1 or trainer.global_step % n != 0
        skip_time, now = True, time.monotonic()
        if self._train_time_interval is not None:
            prev = self._last_time_checked
            skip_time = prev is None or now - prev < self._train_time_interval.total_seconds()
            skip_time = trainer.strategy.broadcast(skip_time, src=0)  # clocks differ across ranks
        if skip_batch and skip_time:
            return
        if not skip_time:
            self._last_time_checked = now
        candidates = self._monitor_candidates(trainer)
        if self.monitor is not None and (
            self.monitor not in candidates or self._validation_follows(trainer, batch_idx)
        ):  # the monitored value is missing or about to be refreshed: save after validation
            self._defer_save_until_validation = True
            return
        if skip_state:
            return
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if not self._should_skip_saving_checkpoint(trainer) and self._should_save_on_train_epoch_end(trainer):
            self._save_after_epoch_or_validation(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._val_has_run = True
        if self._should_skip_saving_checkpoint(trainer) or self._should_save_on_train_epoch_end(trainer):
            return
        if self._defer_save_until_validation:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
            self._defer_save_until_validation = False
            return
        self._save_after_epoch_or_validation(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if not self.save_on_exception or trainer.fast_dev_run or trainer.sanity_checking:
            return
        if self._last_global_step_saved == trainer.global_step:
            return
        candidates = self._monitor_candidates(trainer)
        path = self.format_checkpoint_name(candidates)
        self._save_checkpoint(trainer, path)
        self._save_last_checkpoint(trainer, candidates)
        if trainer.is_global_zero:
            info(
                f"An {type(exception).__name__} was raised with message: {exception}, saved checkpoint to {path}"
            )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.fast_dev_run or trainer.state.fn != "fit":
            return
        if self.save_on_train_end and trainer.global_step != self._last_global_step_saved:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            if self._last_global_step_saved != trainer.global_step:  # top-k did not keep it
                self._save_current(trainer, candidates)
        if self.save_last and not self._last_checkpoint_saved:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def save_now(self, trainer: Any) -> str:
        """Make sure the current step is saved (e.g. on preemption); returns its directory. A no-op
        when this step was saved already. All ranks must call it."""
        if self._last_global_step_saved != trainer.global_step or not self._last_checkpoint_saved:
            candidates = self._monitor_candidates(trainer)
            if self.monitor is None and self.save_top_k != 0:  # the save top-k would make
                self._save_none_monitor_checkpoint(trainer, candidates)
            else:  # never ranked (the metric may be stale): kept as the newest, like save_last's
                self._save_current(trainer, candidates)
        return self._last_checkpoint_saved

    # ------------------------------------------------------------------------------ decisions
    def _save_after_epoch_or_validation(self, trainer: Any) -> None:
        candidates = self._monitor_candidates(trainer)
        if self._every_n_epochs >= 1 and (trainer.current_epoch + 1) % self._every_n_epochs == 0:
            self._save_topk_checkpoint(trainer, candidates)
        if self._last_global_step_saved == trainer.global_step:  # only when this step was saved
            self._save_last_checkpoint(trainer, candidates)

    def _should_skip_saving_checkpoint(self, trainer: Any) -> bool:
        return (
            bool(trainer.fast_dev_run)
            or trainer.state.fn != "fit"
            or trainer.sanity_checking
            or self._last_global_step_saved == trainer.global_step
        )

    def _should_save_on_train_epoch_end(self, trainer: Any) -> bool:
        """Save at the train epoch end only when validation runs exactly once per epoch, at its end
        (or never); otherwise after every validation."""
        if self._save_on_train_epoch_end is not None:
            return self._save_on_train_epoch_end
        if trainer.check_val_every_n_epoch != 1:
            return False
        if sum(trainer.num_val_batches) == 0:
            return True
        return trainer.val_check_interval == 1.0

    def _validation_follows(self, trainer: Any, batch_idx: int) -> bool:
        """Lightning defers a step-triggered save at an epoch's last batch to the validation that
        runs right after it, so the monitored value is fresh."""
        if self._should_save_on_train_epoch_end(trainer) or batch_idx + 1 != trainer.num_training_batches:
            return False
        every = trainer.check_val_every_n_epoch
        runs = every is None or (trainer.current_epoch + 1) % every == 0
        return sum(trainer.num_val_batches) > 0 and runs

    def _monitor_candidates(self, trainer: Any) -> dict[str, Tensor]:
        candidates = {k: v.detach().clone() for k, v in trainer.callback_metrics.items()}
        epoch, step = candidates.get("epoch"), candidates.get("step")
        candidates["epoch"] = (
            epoch.int() if isinstance(epoch, Tensor) else torch.tensor(trainer.current_epoch)
        )
        candidates["step"] = step.int() if isinstance(step, Tensor) else torch.tensor(trainer.global_step)
        return candidates

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            rank_zero_warn(message)
