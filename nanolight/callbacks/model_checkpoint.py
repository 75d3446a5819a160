"""`ModelCheckpoint`: periodic full-training checkpoints, ``last`` pointer, top-k / keep-newest-N.

Saves ``<dirpath>/step-<N>/`` (see ``nanolight/checkpoint/save.py`` for the layout and
atomicity) at the end of every ``every_n_train_steps``-th optimizer step, or at the end of each
training epoch when that is None. Pruning never removes the directory ``last`` points at.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from nanolight.callbacks.base import Callback
from nanolight.checkpoint.atomic import remove_stale


class ModelCheckpoint(Callback):
    """Args:
    dirpath: where step dirs go (default ``<default_root_dir>/checkpoints``).
    every_n_train_steps: save cadence in optimizer steps (None: at each train epoch end).
    save_last: keep the ``last`` pointer on the newest checkpoint.
    monitor / mode / save_top_k: keep the ``save_top_k`` best by ``callback_metrics[monitor]``
        (-1 keeps all). Without ``monitor``, ``save_top_k`` >= 1 keeps the newest that many.
    keep_last_n: additionally (or instead) keep the newest N.
    save_on_train_end: also save the step training ends at (when it was not saved already), so
        the end of a run is never lost between periodic saves (the recipe turns it on).
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        every_n_train_steps: int | None = None,
        save_last: bool = True,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = -1,
        keep_last_n: int | None = None,
        save_on_train_end: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1 or None, got {every_n_train_steps}")
        if keep_last_n is not None and keep_last_n < 1:
            raise ValueError(f"keep_last_n must be >= 1 or None, got {keep_last_n}")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.every_n_train_steps = every_n_train_steps
        self.save_last = save_last
        self.monitor, self.mode, self.save_top_k, self.keep_last_n = monitor, mode, save_top_k, keep_last_n
        self.save_on_train_end = save_on_train_end
        self.saved: list[str] = []  # oldest first
        self.scores: dict[str, float] = {}
        self.last_saved_step = -1

    @property
    def state_key(self) -> str:
        return f"ModelCheckpoint[{self.monitor},{self.every_n_train_steps}]"

    @property
    def best_model_path(self) -> str | None:
        if not self.scores:
            return self.saved[-1] if self.saved else None
        pick = min if self.mode == "min" else max
        return pick(self.scores, key=self.scores.__getitem__)

    @property
    def best_model_score(self) -> float | None:
        path = self.best_model_path
        return self.scores.get(path) if path else None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "checkpoints"
        if stage == "fit":  # every rank writes here: make sure every rank sees it, now, not at the first save
            trainer.strategy.check_shared_directory(self.dirpath)
        if trainer.is_global_zero and self.dirpath.is_dir():
            remove_stale(self.dirpath)  # temporary directories of saves that were killed

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # the step training starts from (0, or the one resumed) is not saved again
        self.last_saved_step = max(self.last_saved_step, trainer.global_step)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = self.every_n_train_steps
        if n is not None and trainer.global_step % n == 0:
            self.save(trainer)  # once per step: a micro-batch before the update sees the last step

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.save_on_train_end and trainer.global_step > 0:
            self.save(trainer)  # a no-op when this step was saved already

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.every_n_train_steps is None:
            self.save(trainer)

    def save(self, trainer: Any) -> None:
        """Save at the current global step (once per step) and prune."""
        step = trainer.global_step
        if step == self.last_saved_step:
            return
        self.last_saved_step = step
        path = str(self.dirpath / f"step-{step}")
        if self.monitor is not None:
            value = trainer.callback_metrics.get(self.monitor)
            if value is None:  # e.g. before the first validation: save, but rank it worst
                rank_zero_warn(
                    f"ModelCheckpoint(monitor={self.monitor!r}): not logged yet at step {step} "
                    f"(logged: {sorted(trainer.callback_metrics)}); ranking this checkpoint last"
                )
            score = float(value) if value is not None else math.nan
            self.scores[path] = (
                score if math.isfinite(score) else (math.inf if self.mode == "min" else -math.inf)
            )
        if path in self.saved:
            self.saved.remove(path)
        self.saved.append(path)
        trainer.save_checkpoint(path, update_last=self.save_last)
        if trainer.is_global_zero:
            for lg in trainer.loggers:
                lg.after_save_checkpoint(path)
            self._prune()

    def _keep(self) -> set[str]:
        keep = {self.saved[-1]}  # the newest: `last` points here
        if self.monitor is not None:
            ranked = sorted(self.scores, key=self.scores.__getitem__, reverse=self.mode == "max")
            keep |= set(ranked if self.save_top_k < 0 else ranked[: self.save_top_k])
        elif self.keep_last_n is None:
            keep |= set(self.saved if self.save_top_k < 0 else self.saved[-self.save_top_k :])
        if self.keep_last_n is not None:
            keep |= set(self.saved[-self.keep_last_n :])
        return keep

    def _prune(self) -> None:
        keep = self._keep()
        for path in [p for p in self.saved if p not in keep]:
            shutil.rmtree(path, ignore_errors=True)
            self.saved.remove(path)
            self.scores.pop(path, None)

    def state_dict(self) -> dict[str, Any]:
        return {
            "saved": list(self.saved),
            "scores": dict(self.scores),
            "last_saved_step": self.last_saved_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved = [p for p in state_dict.get("saved", []) if Path(p).exists()]
        self.scores = {p: s for p, s in state_dict.get("scores", {}).items() if p in self.saved}
        self.last_saved_step = state_dict.get("last_saved_step", -1)
