"""`TrainerConfig`: NanoTrainer's loop options with Lightning's names and defaults, validated with
fix-it messages; and the Lightning arguments nanolight deliberately does not take (an error that
says so, never silently ignored)."""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from typing import Any

from nanolight.errors import UsageError

UNSUPPORTED = {
    "profiler": "profile with torch.profiler around trainer.fit",
    "plugins": "precision and environments are nanolight's own: use precision= and the strategy",
    "sync_batchnorm": "nanolight's data parallelism does not convert BatchNorm layers",
    "model_registry": "there is no model registry: save with trainer.save_checkpoint / save_pretrained",
}


# Lightning's default for each: a program that spells the default out asks for nothing missing
UNSUPPORTED_DEFAULTS: dict[str, Any] = {"profiler": None, "plugins": None, "sync_batchnorm": False, "model_registry": None}


def unsupported_args(kwargs: dict[str, Any]) -> None:
    """Raise for a Lightning argument nanolight does not take (unless at Lightning's default:
    ``sync_batchnorm=False`` asks for nothing), or an unknown one."""
    for key, value in kwargs.items():
        if key in UNSUPPORTED and value is not UNSUPPORTED_DEFAULTS[key]:
            raise UsageError(f"NanoTrainer({key}=...) is a Lightning argument nanolight does not support: {UNSUPPORTED[key]}")
    unknown = sorted(k for k in kwargs if k not in UNSUPPORTED)
    if unknown:
        raise TypeError(f"NanoTrainer got unexpected arguments {unknown}")


def parse_max_time(value: Any) -> float | None:
    """Lightning's forms: "DD:HH:MM:SS", a timedelta, or a dict of timedelta fields -> seconds."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, dict):
        return datetime.timedelta(**value).total_seconds()
    if isinstance(value, str) and re.fullmatch(r"\d+:\d{1,2}:\d{1,2}:\d{1,2}", value):
        d, h, m, s = (int(x) for x in value.split(":"))
        return datetime.timedelta(days=d, hours=h, minutes=m, seconds=s).total_seconds()
    raise UsageError(f'max_time={value!r}: use "DD:HH:MM:SS", a datetime.timedelta or a dict such as {{"hours": 2}}')


def _check_limit(name: str, value: int | float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise UsageError(f"{name} must be an int >= 0 (batches) or a float in [0, 1] (a fraction), got {value!r}")
    if isinstance(value, float) and value > 1.0:
        raise UsageError(f"{name}={value}: a float is a fraction of the loader in [0, 1]; use an int for a count")


@dataclass
class TrainerConfig:
    """Loop knobs (Lightning's meaning for each). ``val_check_interval``: a float is a fraction of
    the training epoch, an int a count of training batches (with ``check_val_every_n_epoch=None``
    counted across epochs)."""

    max_steps: int = -1
    max_epochs: int | None = None
    min_steps: int | None = None
    min_epochs: int | None = None
    max_time: Any = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = 1
    num_sanity_val_steps: int | None = None
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None
    overfit_batches: int | float = 0.0
    log_every_n_steps: int | None = None
    fast_dev_run: int | bool = False
    reload_dataloaders_every_n_epochs: int = 0

    def __post_init__(self) -> None:
        if self.accumulate_grad_batches < 1:
            raise UsageError(f"accumulate_grad_batches must be >= 1, got {self.accumulate_grad_batches}")
        if self.gradient_clip_val is not None and self.gradient_clip_val < 0:
            raise UsageError(f"gradient_clip_val must be >= 0 or None, got {self.gradient_clip_val}")
        if self.gradient_clip_algorithm is not None:
            self.gradient_clip_algorithm = self.gradient_clip_algorithm.lower()
            if self.gradient_clip_algorithm not in ("norm", "value"):
                raise UsageError(f'gradient_clip_algorithm must be "norm" or "value", got {self.gradient_clip_algorithm!r}')
        self.max_time_s = parse_max_time(self.max_time)
        vci = self.val_check_interval
        if vci is None:
            self.val_check_interval = 1.0
        elif isinstance(vci, bool) or not isinstance(vci, (int, float)) or vci <= 0:
            raise UsageError(f"val_check_interval: an int >= 1 (training batches) or a float in (0, 1], got {vci!r}")
        elif isinstance(vci, float) and vci > 1.0:
            raise UsageError(f"val_check_interval={vci}: a float is a fraction of the epoch; use an int for batches")
        if self.check_val_every_n_epoch is not None and self.check_val_every_n_epoch < 1:
            raise UsageError(f"check_val_every_n_epoch must be >= 1 or None, got {self.check_val_every_n_epoch}")
        if self.check_val_every_n_epoch is None and not isinstance(self.val_check_interval, int):
            raise UsageError("check_val_every_n_epoch=None counts val_check_interval across epochs: give it an int")
        self.num_sanity_val_steps = 2 if self.num_sanity_val_steps is None else self.num_sanity_val_steps
        if self.num_sanity_val_steps < -1:
            raise UsageError(f"num_sanity_val_steps must be >= -1 (-1: the whole loader), got {self.num_sanity_val_steps}")
        self.log_every_n_steps = 50 if self.log_every_n_steps is None else self.log_every_n_steps
        if self.log_every_n_steps < 0:
            raise UsageError(f"log_every_n_steps must be >= 0 (0: no step rows), got {self.log_every_n_steps}")
        for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
            if getattr(self, name) is None:
                setattr(self, name, 1.0)
            _check_limit(name, getattr(self, name))
        _check_limit("overfit_batches", self.overfit_batches)
        if self.overfit_batches:
            self.limit_train_batches = self.limit_val_batches = self.overfit_batches
        if self.fast_dev_run:
            n = 1 if self.fast_dev_run is True else int(self.fast_dev_run)
            if n < 1:
                raise UsageError(f"fast_dev_run must be True or an int >= 1, got {self.fast_dev_run!r}")
            self.fast_dev_run = n
            self.max_steps, self.max_epochs, self.num_sanity_val_steps = n, 1, 0
            self.limit_train_batches = self.limit_val_batches = n
            self.limit_test_batches = self.limit_predict_batches = n
            self.val_check_interval, self.check_val_every_n_epoch, self.log_every_n_steps = 1.0, 1, 1
        else:
            self.fast_dev_run = 0
        if self.max_steps < -1:
            raise UsageError(f"max_steps must be -1 (no limit) or >= 0, got {self.max_steps}")
        if self.max_epochs is None:  # Lightning's default: 1000 epochs unless another limit is set
            self.max_epochs = 1000 if self.max_steps == -1 and self.max_time_s is None else -1
        if self.max_epochs is not None and self.max_epochs < -1:
            raise UsageError(f"max_epochs must be -1 (no limit), None or >= 0, got {self.max_epochs}")
