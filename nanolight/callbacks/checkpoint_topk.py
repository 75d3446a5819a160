"""`ModelCheckpoint`'s selection and bookkeeping: names, top-k, ``save_last``, pruning, its state.

A mixin so the callback file holds the hooks and triggers and this one what gets kept. The rules
are Lightning's (``best_k_models``, ``kth_best_model_path``, ``kth_value``, ``best_model_path``,
``best_model_score``, ``current_score``) plus nanolight's: ``keep_last_n`` and the ``last``
pointer's target are never pruned.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import yaml
from torch import Tensor

from nanolight.callbacks import checkpoint_files as files
from nanolight.callbacks.checkpoint_names import format_name
from nanolight.callbacks.messages import info
from nanolight.checkpoint.atomic import LAST_POINTER
from nanolight.errors import UsageError


class TopKMixin:
    """Needs the attributes `ModelCheckpoint.__init__` sets."""

    def format_checkpoint_name(
        self,
        metrics: dict[str, Any],
        filename: str | None = None,
        ver: int | None = None,
        prefix: str | None = None,
    ) -> str:
        """The checkpoint directory for `metrics` (Lightning's method, minus the ``.ckpt``)."""
        name = format_name(filename or self.filename, metrics, self.auto_insert_metric_name, prefix, ver)
        return os.path.join(self.dirpath, name) if self.dirpath else name

    def _get_metric_interpolated_filepath_name(
        self, candidates: dict[str, Tensor], trainer: Any, del_filepath: str | None = None
    ) -> str:
        """The formatted name, with ``-v1``, ``-v2``... while that name is taken (unless it is the
        checkpoint about to be replaced)."""
        path = self.format_checkpoint_name(candidates)
        if self._enable_version_counter:
            ver = self.STARTING_VERSION
            while path != del_filepath and files.exists(trainer, path):
                path = self.format_checkpoint_name(candidates, ver=ver)
                ver += 1
        return path

    def file_exists(self, filepath: str, trainer: Any) -> bool:
        return files.exists(trainer, filepath)

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
            self._warn_once(message)
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
        current = candidates.get(self.monitor)
        if current is not None and not isinstance(current, Tensor):
            current = torch.tensor(float(current))
        if self.check_monitor_top_k(trainer, current):
            self._update_best_and_save(current, trainer, candidates)
        elif self.verbose and trainer.is_global_zero:
            epoch, step = candidates["epoch"], candidates["step"]
            info(f"Epoch {epoch:d}, global step {step:d}: {self.monitor!r} was not in top {self.save_top_k}")

    def _save_none_monitor_checkpoint(self, trainer: Any, candidates: dict[str, Tensor]) -> None:
        path = self._get_metric_interpolated_filepath_name(candidates, trainer, self.best_model_path)
        self.best_model_path = path  # set before saving: it is part of the saved state
        self._save_checkpoint(trainer, path, topk=True)

    def _update_best_and_save(self, current: Tensor, trainer: Any, candidates: dict[str, Tensor]) -> None:
        k = len(self.best_k_models) + 1 if self.save_top_k == -1 else self.save_top_k
        del_filepath = None
        if len(self.best_k_models) == k and k > 0:
            del_filepath = self.kth_best_model_path
            self.best_k_models.pop(del_filepath)
        if torch.isnan(current):  # never keep nan: it ranks worst
            current = torch.tensor(float("inf" if self.mode == "min" else "-inf"), device=current.device)
        path = self._get_metric_interpolated_filepath_name(candidates, trainer, del_filepath)
        self.current_score = current
        self.best_k_models[path] = current
        if len(self.best_k_models) == k:
            worst = max if self.mode == "min" else min
            self.kth_best_model_path = worst(self.best_k_models, key=self.best_k_models.get)
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        best = min if self.mode == "min" else max
        self.best_model_path = best(self.best_k_models, key=self.best_k_models.get)
        self.best_model_score = self.best_k_models[self.best_model_path]
        if self.verbose and trainer.is_global_zero:
            epoch, step = candidates["epoch"], candidates["step"]
            info(
                f"Epoch {epoch:d}, global step {step:d}: {self.monitor!r} reached {current:0.5f}"
                f" (best {self.best_model_score:0.5f}), saving model to {path!r} as top {k}"
            )
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
        # save_last=False: no `last` pointer either (None, the default, keeps nanolight's pointer)
        trainer.save_checkpoint(path, weights_only=self.save_weights_only, update_last=self.save_last is not False)
        self._last_global_step_saved = trainer.global_step
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)
        self._prune(trainer)

    def _kept(self) -> set[str]:
        keep = {self._last_checkpoint_saved}  # the newest: `last` points at it
        if self.monitor is not None:
            keep |= set(self.best_k_models)
        elif self.save_top_k == -1:
            keep |= {p for p, by_topk in self._saved.items() if by_topk}
        elif self.save_top_k == 1 and self.best_model_path:
            keep.add(self.best_model_path)
        if self.keep_last_n is not None:
            keep |= set(list(self._saved)[-self.keep_last_n :])
        return keep

    def _prune(self, trainer: Any) -> None:
        """Remove the checkpoints nothing keeps any more (rank zero deletes, all ranks forget)."""
        kept = self._kept()
        doomed = [p for p in self._saved if p not in kept]
        if trainer.is_global_zero and doomed:
            pointer = files.pointer_target(self.dirpath)
            doomed = [
                p for p in doomed if pointer is None or os.path.realpath(p) != os.path.realpath(pointer)
            ]
            for path in doomed:
                if files.is_inside(path, self.dirpath):
                    files.remove_checkpoint_dir(path)
        for path in trainer.strategy.broadcast(doomed, src=0):
            self._saved.pop(path, None)

    def to_yaml(self, filepath: str | None = None) -> None:
        """Write ``best_k_models`` (path: score) to ``<dirpath>/best_k_models.yaml``."""
        best_k = {k: v.item() for k, v in self.best_k_models.items()}
        with open(filepath or os.path.join(self.dirpath, "best_k_models.yaml"), "w") as f:
            yaml.dump(best_k, f)

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
            self.kth_best_model_path = state_dict.get("kth_best_model_path", self.kth_best_model_path)
            self.kth_value = state_dict.get("kth_value", self.kth_value)
            self.best_k_models = state_dict.get("best_k_models", self.best_k_models)
            self.last_model_path = state_dict.get("last_model_path", self.last_model_path)
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
