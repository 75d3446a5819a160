"""`RichProgressBar`: steps, loss, tokens/s and ETA.

On a terminal it draws a rich progress bar; otherwise (CI logs, pipes, ``nohup``) a live bar
would spam or vanish, so it prints one plain line every ``log_every_n_steps`` steps instead.
Only global rank zero draws.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from nanolight.callbacks.base import Callback


class RichProgressBar(Callback):
    """Progress over optimizer steps (``max_steps``, or open-ended when it is unset). The step
    count moves every step; loss and tokens/s refresh on logging steps (reading them syncs the
    device)."""

    def __init__(self, force_plain: bool = False) -> None:
        self.force_plain = force_plain
        self._progress: Any = None
        self._task: Any = None
        self._t0 = 0.0
        self._tokens0 = 0
        self._step = 0  # the global step last shown

    def _fields(self, trainer: Any) -> dict[str, str]:
        m = {k: float(v) for k, v in trainer.progress_bar_metrics.items()}  # syncs: logging steps only
        loss = m.get("train/loss")
        dt = max(time.perf_counter() - self._t0, 1e-9)
        tps = (trainer.progress["tokens"] - self._tokens0) / dt
        out = {"loss": f"{loss:.4f}" if loss is not None else "-", "tps": f"{tps:,.0f}" if tps else "-"}
        extra = {k: v for k, v in m.items() if k != "train/loss"}
        out["extra"] = "  ".join(f"{k}={v:.4g}" for k, v in extra.items())
        return out

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._step = trainer.global_step
        if not trainer.is_global_zero:
            return
        self._t0, self._tokens0 = time.perf_counter(), trainer.progress["tokens"]
        if self.force_plain or not sys.stdout.isatty():
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeRemainingColumn(),
            TextColumn("loss {task.fields[loss]}  tok/s {task.fields[tps]}  {task.fields[extra]}"),
        )
        total = trainer.max_steps if trainer.max_steps > 0 else None
        self._task = self._progress.add_task(
            "train", total=total, completed=trainer.global_step, loss="-", tps="-", extra=""
        )
        self._progress.start()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero or trainer.global_step == self._step:
            return  # another rank, or a micro-batch before this step's update
        self._step = trainer.global_step
        if self._progress is not None:
            fields = self._fields(trainer) if trainer.should_log else {}
            self._progress.update(self._task, completed=trainer.global_step, **fields)
        elif trainer.should_log:
            f = self._fields(trainer)
            total = f"/{trainer.max_steps}" if trainer.max_steps > 0 else ""
            print(
                f"step {trainer.global_step}{total}  loss {f['loss']}  tok/s {f['tps']}  {f['extra']}".rstrip(),
                flush=True,
            )

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop()
