"""`Timer`: stop training once a wall-clock budget is spent (Lightning's callback), and report
the time each stage took. The clock is ``time.monotonic`` (looked up at each read, so a test can
replace it); training time carries over a resume through the callback's checkpoint state."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from nanolight.callbacks.base import Callback, info
from nanolight.errors import UsageError

if TYPE_CHECKING:
    from nanolight.module import NanoModule
    from nanolight.trainer import NanoTrainer

INTERVALS = ("step", "epoch")
# `trainer.states.RunningStage`'s values (callbacks sit below the trainer: strings, not the enum)
STAGES = ("train", "sanity_check", "validate", "test", "predict")
TRAIN = "train"


def _stage(stage: str) -> str:
    if stage not in STAGES:
        raise ValueError(f"{stage!r} is not a stage; use one of {', '.join(STAGES)}")
    return getattr(stage, "value", stage)  # a `RunningStage` or its value


def parse_duration(duration: str | timedelta | dict[str, int] | None) -> float | None:
    """Seconds of a ``"DD:HH:MM:SS"`` string, a `timedelta` or `timedelta`'s keywords as a dict."""
    if isinstance(duration, str):
        match = re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", duration.strip())
        if not match:
            raise UsageError(f"Timer(duration={duration!r}) is not a valid duration: use 'DD:HH:MM:SS'")
        days, hours, minutes, seconds = map(int, match.groups())
        duration = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif isinstance(duration, dict):
        duration = timedelta(**duration)
    return None if duration is None else duration.total_seconds()


class Timer(Callback):
    """``Timer(duration="00:12:00:00", interval="step")`` stops training after 12 hours, checked
    after every training batch (``"epoch"``: at every epoch end) and when fit starts (a restored
    budget may be spent already). `time_elapsed`, `start_time`, `end_time` and `time_remaining`
    take a stage (``"train"``, ``"validate"``, ``"test"``, ...) and answer in seconds."""

    def __init__(
        self,
        duration: str | timedelta | dict[str, int] | None = None,
        interval: str = "step",
        verbose: bool = True,
    ) -> None:
        if interval not in INTERVALS:
            raise UsageError(f"Timer(interval={interval!r}) is not supported: use 'step' or 'epoch'")
        self._duration = parse_duration(duration)
        self._interval = interval
        self._verbose = verbose
        self._start_time: dict[str, float | None] = dict.fromkeys(STAGES)
        self._end_time: dict[str, float | None] = dict.fromkeys(STAGES)
        self._offset = 0.0  # training seconds restored from a checkpoint

    def start_time(self, stage: str = TRAIN) -> float | None:
        """When `stage` last started (``time.monotonic`` seconds), None if it never did."""
        return self._start_time[_stage(stage)]

    def end_time(self, stage: str = TRAIN) -> float | None:
        """When `stage` last ended, None if it has not."""
        return self._end_time[_stage(stage)]

    def time_elapsed(self, stage: str = TRAIN) -> float:
        """Seconds `stage` has run (its last run; training adds the time restored on resume)."""
        start, end = self.start_time(stage), self.end_time(stage)
        offset = self._offset if _stage(stage) == TRAIN else 0
        if start is None:
            return offset
        return (time.monotonic() if end is None else end) - start + offset

    def time_remaining(self, stage: str = TRAIN) -> float | None:
        """Seconds left of the budget (negative once overrun); None without a duration."""
        return None if self._duration is None else self._duration - self.time_elapsed(stage)

    def _mark(self, times: dict[str, float | None], stage: str) -> None:
        times[stage] = time.monotonic()

    def on_train_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None:
        self._mark(self._start_time, TRAIN)

    def on_train_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None:
        self._mark(self._end_time, TRAIN)

    def on_validation_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None:
        self._mark(self._start_time, "validate")

    def on_validation_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None:
        self._mark(self._end_time, "validate")

    def on_test_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None:
        self._mark(self._start_time, "test")

    def on_test_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None:
        self._mark(self._end_time, "test")

    def on_fit_start(self, trainer: NanoTrainer, pl_module: NanoModule) -> None:
        if self._duration is not None:  # a restored budget may be spent already
            self._check(trainer)

    def on_train_batch_end(self, trainer: NanoTrainer, *args: Any, **kwargs: Any) -> None:
        if self._interval == "step" and self._duration is not None:
            self._check(trainer)

    def on_train_epoch_end(self, trainer: NanoTrainer, pl_module: NanoModule) -> None:
        if self._interval == "epoch" and self._duration is not None:
            self._check(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in STAGES}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._offset = state_dict.get("time_elapsed", {}).get(TRAIN, 0)

    def _check(self, trainer: NanoTrainer) -> None:
        """Ask the trainer to stop once the budget is spent (rank 0's clock decides for all)."""
        assert self._duration is not None
        spent = trainer.strategy.broadcast(self.time_elapsed() >= self._duration)
        trainer.should_stop = trainer.should_stop or spent
        if spent and self._verbose:
            elapsed = timedelta(seconds=int(self.time_elapsed()))
            info(f"Time limit reached. Elapsed time is {elapsed}. Signaling Trainer to stop.")
