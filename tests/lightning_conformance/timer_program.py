"""The promises of Lightning 2.6.6's ``tests_pytorch/callbacks/test_timer.py``, as scenarios of ours, on a
fake clock (``time.monotonic`` replaced by a counter the module advances: 10 s a training step, 1 s a
validation step, 2 s a test step), so every elapsed time and stopping point is exact. One section per
promise (see COVERAGE.md); run: ``python timer_program.py OUTDIR``.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.demos.boring_classes import BoringModel
from observe import raises, run_sections

QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}
CLOCK = [1000.0]


def fake_clock() -> float:
    return CLOCK[0]


class ClockModel(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        CLOCK[0] += 10.0
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        CLOCK[0] += 1.0
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        CLOCK[0] += 2.0
        return super().test_step(batch, batch_idx)


def _timers(trainer: Any) -> list[Timer]:
    return [c for c in trainer.callbacks if isinstance(c, Timer)]


def _report(timer: Timer) -> dict[str, Any]:
    return {
        stage: [
            timer.time_elapsed(stage),
            timer.start_time(stage) is not None,
            timer.end_time(stage) is not None,
        ]
        for stage in ("train", "validate", "test")
    } | {"remaining": timer.time_remaining()}


def _trainer(outdir: str, **kwargs: Any) -> L.Trainer:
    limits = {"limit_train_batches": 4, "limit_val_batches": 2, "num_sanity_val_steps": 0}
    return L.Trainer(default_root_dir=outdir, **{**limits, **kwargs}, **QUIET)


class StopAtFitStart(ClockModel):
    def on_fit_start(self) -> None:
        raise SystemExit()


def trainer_flag(outdir: str) -> dict[str, Any]:
    """``max_time`` adds a Timer; a Timer in the callbacks wins; ``max_epochs=-1`` is kept."""
    out = {}
    for name, kwargs in {
        "max_time": {"max_time": {"seconds": 1337}},
        "with_timer": {"max_time": {"seconds": 1337}, "callbacks": [Timer()]},
        "max_epochs_-1": {"max_time": {"seconds": 1}, "max_epochs": -1},
    }.items():
        trainer = L.Trainer(default_root_dir=outdir, **kwargs, **QUIET)
        try:
            trainer.fit(StopAtFitStart())
        except SystemExit:
            pass
        out[name] = {
            "timers": [t.time_remaining() for t in _timers(trainer)],
            "max_epochs": trainer.max_epochs,
            "max_steps": trainer.max_steps,
        }
    return out


def parse_duration(outdir: str) -> dict[str, Any]:
    durations = [
        None,
        "00:00:00:22",
        "12:34:56:65",
        timedelta(weeks=52, milliseconds=1),
        {"weeks": 52, "days": 1},
    ]
    return {"remaining": [Timer(duration=d).time_remaining() for d in durations]}


def parse_duration_misconfiguration(outdir: str) -> dict[str, Any]:
    return {d: raises(lambda d=d: Timer(duration=d)) for d in ("6:00:00", "60 minutes")}


def interval_choice(outdir: str) -> dict[str, Any]:
    return {
        i: raises(lambda i=i: Timer(duration=timedelta(), interval=i)) for i in ("step", "epoch", "invalid")
    }


class Probe(L.Callback):
    def __init__(self, timer: Timer) -> None:
        self.timer = timer
        self.seen: list[list[Any]] = []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        t = self.timer
        self.seen.append(
            [trainer.global_step, t.time_elapsed(), t.time_remaining(), t.start_time() is not None]
        )


def time_remaining(outdir: str) -> dict[str, Any]:
    timer = Timer(duration=timedelta(seconds=100))
    before = [timer.time_remaining(), timer.time_elapsed(), timer.start_time()]
    CLOCK[0] += 60.0  # not started: nothing elapses
    still = [timer.time_remaining(), timer.time_elapsed(), timer.start_time()]
    probe = Probe(timer)
    trainer = _trainer(outdir, max_steps=3, callbacks=[timer, probe])
    trainer.fit(ClockModel())
    return {"before": before, "not_started": still, "during": probe.seen, "after": _report(timer)}


def stops_training(outdir: str) -> dict[str, Any]:
    timer = Timer(duration=timedelta(seconds=55))
    trainer = _trainer(outdir, max_epochs=1000, callbacks=[timer])
    trainer.fit(ClockModel())
    return {"global_step": trainer.global_step, "current_epoch": trainer.current_epoch, **_report(timer)}


def zero_duration_stop(outdir: str) -> dict[str, Any]:
    out = {}
    for interval in ("step", "epoch"):
        timer = Timer(duration=timedelta(0), interval=interval)
        trainer = _trainer(outdir, callbacks=[timer])
        trainer.fit(ClockModel())
        out[interval] = [trainer.global_step, trainer.current_epoch, timer.time_elapsed()]
    return out


def duration_min_steps_override(outdir: str) -> dict[str, Any]:
    out = {}
    for min_steps, min_epochs in ((None, 2), (3, None), (3, 2)):
        timer = Timer(duration=timedelta(0))
        trainer = _trainer(outdir, callbacks=[timer], min_steps=min_steps, min_epochs=min_epochs)
        trainer.fit(ClockModel())
        out[f"{min_steps}-{min_epochs}"] = [trainer.global_step, trainer.current_epoch, timer.time_elapsed()]
    return out


def resume_training(outdir: str) -> dict[str, Any]:
    checkpoint = ModelCheckpoint(dirpath=os.path.join(outdir, "ckpts"), save_top_k=-1)
    timer = Timer(duration=timedelta(seconds=95))
    trainer = _trainer(outdir, max_epochs=100, callbacks=[timer, checkpoint])
    model = ClockModel()
    trainer.fit(model)
    first = {"global_step": trainer.global_step, "current_epoch": trainer.current_epoch, **_report(timer)}
    timer = Timer(duration=timedelta(seconds=95))
    trainer = _trainer(outdir, callbacks=timer)
    trainer.fit(model, ckpt_path=checkpoint.best_model_path)
    resumed = {"global_step": trainer.global_step, "current_epoch": trainer.current_epoch, **_report(timer)}
    return {"first": first, "resumed": resumed}


def track_stages(outdir: str) -> dict[str, Any]:
    timer = Timer()
    model = ClockModel()
    trainer = _trainer(outdir, max_steps=5, callbacks=[timer], limit_test_batches=3)
    trainer.fit(model)
    after_fit = _report(timer)
    trainer.test(model, verbose=False)
    return {"after_fit": after_fit, "after_test": _report(timer)}


SECTIONS = [
    trainer_flag,
    parse_duration,
    parse_duration_misconfiguration,
    interval_choice,
    time_remaining,
    stops_training,
    zero_duration_stop,
    duration_min_steps_override,
    resume_training,
    track_stages,
]


def seed_and_clock(seed: int) -> None:
    """Each section starts on the fake clock at 1000 s (installed for the whole program)."""
    time.monotonic = fake_clock
    CLOCK[0] = 1000.0
    L.seed_everything(seed)


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_sections(sys.argv[1], SECTIONS, seed_and_clock)
