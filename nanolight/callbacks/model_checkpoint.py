"""`ModelCheckpoint`: Lightning 2.6's checkpoint callback, writing nanolight checkpoint directories.

Arguments, defaults, triggers, top-k selection, names and state follow Lightning's
``ModelCheckpoint`` (see its docs); the differences come from nanolight's format:

* a checkpoint is a directory named by the template (``epoch=6-val_loss=0.682``, no ``.ckpt``);
* every save moves the ``<dirpath>/last`` pointer to it, so ``save_last`` writes no copy: where
  Lightning refreshes ``last.ckpt`` it saves this step if top-k did not (dropping the previous
  such directory); ``last_model_path`` is ``<dirpath>/last``, ``save_last="link"`` acts as True,
  and the directory ``last`` names is never deleted;
* ``/`` in a formatted name (a metric ``val/loss``) becomes ``_``, with a one-time warning: a
  checkpoint sits directly in ``dirpath``, where ``last`` names it by its bare name;
* extras: ``keep_last_n`` keeps the newest N saves besides the top-k ones, ``save_on_train_end``
  saves the last step -- the step that reaches ``max_steps`` where a step-triggered save would
  (inside its epoch: a resume continues that epoch, as from any other step's save), any other end
  at ``on_train_end``; the step training starts from is never saved again.

Every decision that depends on the filesystem or a score is taken on global rank zero and
broadcast, so all ranks agree on names (they all write the same directory).
"""

from __future__ import annotations

import os
import time
import warnings
from datetime import timedelta
from typing import Any, Literal

import torch
import yaml
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor

from nanolight.callbacks.base import Callback, info
from nanolight.callbacks.checkpoint_paths import (
    check_shared_directory,
    default_dirpath,
    format_name,
    remove_checkpoints,
)
from nanolight.checkpoint.atomic import LAST_POINTER, atomic_write_text, remove_stale
from nanolight.errors import UsageError


class ModelCheckpoint(Callback):
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
        if save_top_k < -1:
            raise UsageError(f"ModelCheckpoint(save_top_k={save_top_k}): must be >= -1")
        steps, epochs, interval = every_n_train_steps, every_n_epochs, train_time_interval
        if steps is None and epochs is None and interval is None:
            epochs = 1  # default: once per epoch (after its validation)
        for name, n in (("every_n_train_steps", steps), ("every_n_epochs", epochs)):
            if n is not None and n < 0:
                raise UsageError(f"ModelCheckpoint({name}={n}): must be >= 0")
        if bool(steps) + bool(epochs) + (interval is not None) > 1:
            raise UsageError(
                f"ModelCheckpoint: every_n_train_steps={steps}, every_n_epochs={epochs} and "
                f"train_time_interval={interval} are mutually exclusive; set only one of them"
            )
        if monitor is None and save_top_k not in (-1, 0, 1):
            raise UsageError(
                f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) is not a valid configuration: "
                "no quantity to rank the top k by; pass `monitor=` or use save_top_k in (-1, 0, 1)"
            )
        self.monitor, self.verbose, self.mode = monitor, verbose, mode
        self.save_last, self.save_top_k = save_last, save_top_k
        self.save_on_exception, self.save_weights_only = save_on_exception, save_weights_only
        self.auto_insert_metric_name = auto_insert_metric_name
        self.keep_last_n, self.save_on_train_end = keep_last_n, save_on_train_end
        self._every_n_train_steps, self._every_n_epochs = steps or 0, epochs or 0
        self._train_time_interval = interval
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
        self.kth_value: Tensor = torch.tensor(torch.inf if mode == "min" else -torch.inf)
        self.best_model_score: Tensor | None = None
        self.best_model_path = self.kth_best_model_path = self.last_model_path = ""
        self._saved: dict[str, bool] = {}  # this callback's checkpoints on disk (oldest first): by top-k?
        self._last_only = ""  # the newest state saved only because of save_last

    @property
    def every_n_epochs(self) -> int:
        return self._every_n_epochs

    @property
    def last_checkpoint_saved(self) -> str:
        """The directory this callback saved most recently ("" before its first save)."""
        return self._last_checkpoint_saved

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
        self.dirpath = trainer.strategy.broadcast(self.dirpath or default_dirpath(trainer), src=0)
        if stage != "fit":
            return
        self._val_has_run = False
        check_shared_directory(trainer.strategy, self.dirpath)  # every rank writes here
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
        last = self.save_on_train_end and 0 < trainer.max_steps <= trainer.global_step
        skip_batch = (n < 1 or trainer.global_step % n != 0) and not last
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
        saved = self._last_global_step_saved == trainer.global_step
        if not self.save_on_exception or trainer.fast_dev_run or trainer.sanity_checking or saved:
            return
        candidates = self._monitor_candidates(trainer)
        path = self.format_checkpoint_name(candidates)
        self._save_checkpoint(trainer, path, topk=False)
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
        skip = trainer.fast_dev_run or trainer.state.fn != "fit" or trainer.sanity_checking
        return bool(skip) or self._last_global_step_saved == trainer.global_step

    def _should_save_on_train_epoch_end(self, trainer: Any) -> bool:
        """Save at the train epoch end only when validation runs exactly once per epoch, at its end
        (or never); otherwise after every validation."""
        if self._save_on_train_epoch_end is not None:
            return self._save_on_train_epoch_end
        once = sum(trainer.num_val_batches) == 0 or trainer.val_check_interval == 1.0
        return trainer.check_val_every_n_epoch == 1 and once

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
        for key, value in (("epoch", trainer.current_epoch), ("step", trainer.global_step)):
            candidates[key] = candidates[key].int() if key in candidates else torch.tensor(value)
        return candidates

    def _say(self, trainer: Any, candidates: dict[str, Tensor], message: str) -> None:
        """A ``verbose`` message about this step, from rank zero."""
        if self.verbose and trainer.is_global_zero:
            info(f"Epoch {candidates['epoch']:d}, global step {candidates['step']:d}: {message}")

    # ---------------------------------------------------------------------- names, top-k, pruning
    def format_checkpoint_name(
        self,
        metrics: dict[str, Any],
        filename: str | None = None,
        ver: int | None = None,
        prefix: str | None = None,
    ) -> str:
        """The checkpoint directory for `metrics`: Lightning's method and class attributes, but
        `FILE_EXTENSION` is empty (a checkpoint is a directory, not a ``.ckpt`` file)."""
        join, equals = self.CHECKPOINT_JOIN_CHAR, self.CHECKPOINT_EQUALS_CHAR
        template, auto = filename or self.filename, self.auto_insert_metric_name
        name = format_name(template, metrics, auto, prefix, ver, join, equals) + self.FILE_EXTENSION
        return os.path.join(self.dirpath, name) if self.dirpath else name

    def _get_metric_interpolated_filepath_name(
        self, candidates: dict[str, Tensor], trainer: Any, del_filepath: str | None = None
    ) -> str:
        """The formatted name, with ``-v1``, ``-v2``... while that name is taken (unless it is the
        checkpoint about to be replaced)."""
        path = self.format_checkpoint_name(candidates)
        if self._enable_version_counter:
            ver = self.STARTING_VERSION
            while path != del_filepath and self.file_exists(path, trainer):
                path = self.format_checkpoint_name(candidates, ver=ver)
                ver += 1
        return path

    def file_exists(self, filepath: str, trainer: Any) -> bool:
        """Whether `filepath` exists, as global rank zero sees it (the same answer on every rank)."""
        exists = trainer.is_global_zero and os.path.exists(filepath)
        return bool(trainer.strategy.broadcast(exists, src=0))  # rank zero's answer to every rank

    def _save_topk_checkpoint(self, trainer: Any, candidates: dict[str, Tensor]) -> None:
        if self.save_top_k == 0:
            return
        if self.monitor is None:
            self._save_none_monitor_checkpoint(trainer, candidates)
            return
        if self.monitor not in candidates:
            message = (
                f"`ModelCheckpoint(monitor={self.monitor!r})` could not find the monitored key in the "
                f"returned metrics: {list(candidates)}. HINT: Did you call `log({self.monitor!r}, value)` "
                "in the `NanoModule`?"
            )
            if self._val_has_run:  # validation ran and still did not log it: a misconfiguration
                raise UsageError(message)
            if message not in self._warned:  # once
                self._warned.add(message)
                rank_zero_warn(message)
        self._save_monitor_checkpoint(trainer, candidates)

    def check_monitor_top_k(self, trainer: Any, current: Tensor | None = None) -> bool:
        """Whether `current` enters the top k (rank zero decides, so all ranks agree)."""
        if current is None:
            return False
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        better = torch.lt if self.mode == "min" else torch.gt
        decision = bool(better(current, self.best_k_models[self.kth_best_model_path]))
        return bool(trainer.strategy.broadcast(decision, src=0))

    def _save_monitor_checkpoint(self, trainer: Any, candidates: dict[str, Tensor]) -> None:
        current = candidates.get(self.monitor)  # every candidate is a tensor
        if self.check_monitor_top_k(trainer, current):
            self._update_best_and_save(current, trainer, candidates)
        else:
            self._say(trainer, candidates, f"{self.monitor!r} was not in top {self.save_top_k}")

    def _save_none_monitor_checkpoint(self, trainer: Any, candidates: dict[str, Tensor]) -> None:
        path = self._get_metric_interpolated_filepath_name(candidates, trainer, self.best_model_path)
        self.best_model_path = path  # set before saving: it is part of the saved state
        self._save_checkpoint(trainer, path, topk=True)

    def _update_best_and_save(self, current: Tensor, trainer: Any, candidates: dict[str, Tensor]) -> None:
        k = len(self.best_k_models) + 1 if self.save_top_k == -1 else self.save_top_k
        del_filepath = self.kth_best_model_path if len(self.best_k_models) == k else None  # k > 0 here
        self.best_k_models.pop(del_filepath, None)  # the k-th best makes way
        if torch.isnan(current):  # never keep nan: it ranks worst
            current = torch.tensor(float("inf" if self.mode == "min" else "-inf"), device=current.device)
        path = self._get_metric_interpolated_filepath_name(candidates, trainer, del_filepath)
        self.current_score = current
        self.best_k_models[path] = current
        worst, best = (max, min) if self.mode == "min" else (min, max)
        if len(self.best_k_models) == k:
            self.kth_best_model_path = worst(self.best_k_models, key=self.best_k_models.get)
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        self.best_model_path = best(self.best_k_models, key=self.best_k_models.get)
        self.best_model_score = self.best_k_models[self.best_model_path]
        scores = f"reached {current:0.5f} (best {self.best_model_score:0.5f})"
        self._say(trainer, candidates, f"{self.monitor!r} {scores}, saving model to {path!r} as top {k}")
        self._save_checkpoint(trainer, path, topk=True)

    def _save_last_checkpoint(self, trainer: Any, candidates: dict[str, Tensor]) -> None:
        """Where Lightning refreshes ``last.ckpt``: make sure this step is saved (`last` follows)."""
        if not self.save_last:
            return
        self.last_model_path = os.path.join(self.dirpath, LAST_POINTER)
        if self._last_checkpoint_saved and self._last_global_step_saved == trainer.global_step:
            return  # saved at this step already, and `last` points there
        self._save_current(trainer, candidates)

    def _save_current(self, trainer: Any, candidates: dict[str, Tensor]) -> None:
        """Save this step under its formatted name though top-k did not keep it; the previous such
        directory is pruned (unless kept by top-k or `keep_last_n`)."""
        path = self._get_metric_interpolated_filepath_name(candidates, trainer, self._last_only or None)
        self._last_only = path
        self._save_checkpoint(trainer, path, topk=False)

    def _save_checkpoint(self, trainer: Any, path: str, topk: bool) -> None:
        self._saved.pop(path, None)
        self._saved[path] = topk  # before saving: the bookkeeping is part of the saved state
        self._last_checkpoint_saved = path
        if self.save_last:  # `last` will name this save: a run resumed from it knows (Lightning's last.ckpt)
            self.last_model_path = os.path.join(self.dirpath, LAST_POINTER)
        # save_last=False: no `last` pointer either (None, the default, keeps nanolight's pointer)
        last = self.save_last is not False
        trainer.save_checkpoint(path, weights_only=self.save_weights_only, update_last=last)
        self._last_global_step_saved = trainer.global_step
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)
        self._prune(trainer)

    def _prune(self, trainer: Any) -> None:
        """Remove the checkpoints nothing keeps any more (rank zero deletes, all ranks forget)."""
        keep = {self._last_checkpoint_saved}  # the newest: `last` points at it
        if self.monitor is not None:
            keep |= set(self.best_k_models)
        elif self.save_top_k == -1:
            keep |= {p for p, by_topk in self._saved.items() if by_topk}
        elif self.save_top_k == 1 and self.best_model_path:
            keep.add(self.best_model_path)
        if self.keep_last_n is not None:
            keep |= set(list(self._saved)[-self.keep_last_n :])
        doomed = [p for p in self._saved if p not in keep]
        if trainer.is_global_zero and doomed:
            doomed = remove_checkpoints(doomed, self.dirpath)
        for path in trainer.strategy.broadcast(doomed, src=0):  # rank zero's list: all forget the same
            self._saved.pop(path, None)

    def to_yaml(self, filepath: str | None = None) -> None:
        """Write ``best_k_models`` (path: score) to ``<dirpath>/best_k_models.yaml``."""
        best_k = {k: v.item() for k, v in self.best_k_models.items()}
        atomic_write_text(filepath or os.path.join(self.dirpath, "best_k_models.yaml"), yaml.dump(best_k))

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "best_model_score": self.best_model_score,
            "best_model_path": self.best_model_path,
            "current_score": self.current_score,
            "dirpath": self.dirpath,
            "best_k_models": self.best_k_models,
            "kth_best_model_path": self.kth_best_model_path,
            "kth_value": self.kth_value,
            "last_model_path": self.last_model_path,
            "saved": [[p, by_topk] for p, by_topk in self._saved.items()],  # nanolight: for pruning
            "last_only": self._last_only,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "best_model_path" not in state_dict:  # a nanolight checkpoint from before Lightning's fields
            return
        saved_dirpath = state_dict.get("dirpath", self.dirpath)
        if self.dirpath == saved_dirpath:
            self.best_model_score = state_dict["best_model_score"]
            for key in ("kth_best_model_path", "kth_value", "best_k_models", "last_model_path"):
                setattr(self, key, state_dict.get(key, getattr(self, key)))
            self._saved = {p: bool(t) for p, t in state_dict.get("saved", []) if os.path.isdir(p)}
            self._last_only = state_dict.get("last_only", "")
            self._last_checkpoint_saved = next(reversed(self._saved), "")
        else:
            warnings.warn(
                f"The dirpath has changed from {saved_dirpath!r} to {self.dirpath!r}, therefore "
                "`best_model_score`, `kth_best_model_path`, `kth_value`, `last_model_path` and "
                "`best_k_models` won't be reloaded. Only `best_model_path` will be reloaded.",
                stacklevel=2,
            )
        self.best_model_path = state_dict["best_model_path"]
