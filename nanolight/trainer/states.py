"""What the trainer is doing, as Lightning's ``lightning.pytorch.trainer.states``: the entry point
running (`TrainerFn`), the loop inside it (`RunningStage`) and the call's `TrainerStatus`.

They are string enums (lightning-utilities' ``StrEnum``, Lightning's own base), so a hook that
receives ``setup(stage)`` sees ``TrainerFn.FITTING`` -- printed so, and equal to ``"fit"`` -- exactly
as under Lightning. `TrainerState` turns the plain strings the trainer assigns into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_utilities.core.enums import StrEnum


class TrainerStatus(StrEnum):
    """Where the current (or last) trainer call is."""

    INITIALIZING = "initializing"
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"

    @property
    def stopped(self) -> bool:
        return self in (self.FINISHED, self.INTERRUPTED)


class TrainerFn(StrEnum):
    """The entry point running: ``fit``, ``validate``, ``test``, ``predict``."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class RunningStage(StrEnum):
    """The loop running inside the entry point (fit runs sanity check, training and validation)."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    @property
    def evaluating(self) -> bool:
        return self in (self.VALIDATING, self.TESTING, self.SANITY_CHECKING)

    @property
    def dataloader_prefix(self) -> str | None:
        if self in (self.VALIDATING, self.SANITY_CHECKING):
            return "val"
        return self.value


_KINDS: dict[str, type[StrEnum]] = {"status": TrainerStatus, "fn": TrainerFn, "stage": RunningStage}


@dataclass
class TrainerState:
    """``fn``: the running entry point; ``stage``: the loop running inside it; ``status``. Plain
    strings assigned to them become the enums (``state.stage = "validate"``)."""

    status: TrainerStatus = TrainerStatus.INITIALIZING
    fn: TrainerFn | None = None
    stage: RunningStage | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        kind = _KINDS.get(name)
        super().__setattr__(name, kind(value) if kind is not None and value is not None else value)

    @property
    def finished(self) -> bool:
        return self.status == TrainerStatus.FINISHED

    @property
    def stopped(self) -> bool:
        return self.status.stopped
