"""What a `NanoTrainer` is built from: its default callbacks and loggers, the checks a module
must pass before a call, and the determinism switches (Lightning's defaults for each)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.overrides import is_overridden

from nanolight.callbacks.base import Callback
from nanolight.callbacks.model_checkpoint import ModelCheckpoint
from nanolight.callbacks.model_summary import ModelSummary
from nanolight.callbacks.progress import RichProgressBar
from nanolight.errors import UsageError
from nanolight.loggers.base import Logger
from nanolight.loggers.csv_logger import CSVLogger
from nanolight.module.module import NanoModule
from nanolight.trainer.hooks import order_callbacks


def build_callbacks(callbacks: Any, checkpointing: bool, progress_bar: bool, summary: bool) -> list[Callback]:
    """The user's callbacks plus the defaults (ModelCheckpoint, progress bar, model summary)."""
    cbs = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
    bad = [type(c).__name__ for c in cbs if not isinstance(c, Callback)]
    if bad:
        raise UsageError(f"callbacks must be nanolight Callback instances, got {bad}")
    has_ckpt = any(isinstance(cb, ModelCheckpoint) for cb in cbs)
    if not checkpointing and has_ckpt:
        raise UsageError("enable_checkpointing=False but callbacks holds a ModelCheckpoint: drop one of them")
    if checkpointing and not has_ckpt:
        cbs.append(ModelCheckpoint())
    if progress_bar and not any(isinstance(cb, RichProgressBar) for cb in cbs):
        cbs.append(RichProgressBar())
    if summary and not any(isinstance(cb, ModelSummary) for cb in cbs):
        cbs.append(ModelSummary())
    return order_callbacks(cbs)


def build_loggers(logger: Any, default_root_dir: str | Path, fast_dev_run: bool) -> list[Logger]:
    """None/True -> a CSVLogger under the root dir (Lightning's default without TensorBoard);
    False -> none (fast_dev_run logs nothing either)."""
    if fast_dev_run or logger is False:
        return []
    if logger is None or logger is True:
        return [CSVLogger(save_dir=default_root_dir)]
    loggers = [logger] if isinstance(logger, Logger) else list(logger)
    bad = [type(lg).__name__ for lg in loggers if not isinstance(lg, Logger)]
    if bad:
        raise UsageError(f"logger must be a nanolight Logger (or a list of them), got {bad}")
    for lg in loggers:
        lg.set_default_save_dir(default_root_dir)
    return loggers


def check_module(module: Any, fn: str, strategy: Any) -> None:
    """What a call needs from the module, checked before anything runs."""
    if not isinstance(module, NanoModule):
        raise UsageError(f"expected a NanoModule, got {type(module).__name__}")
    needs = {"fit": ["training_step", "configure_optimizers"], "validate": ["validation_step"],
             "test": ["test_step"], "predict": []}[fn]  # fmt: skip
    missing = [h for h in needs if not is_overridden(h, module, NanoModule)]
    if missing:
        raise UsageError(f"{type(module).__name__} must implement {' and '.join(missing)} for trainer.{fn}()")


def check_manual(module: NanoModule, config: Any, strategy: Any) -> None:
    """Manual optimization: the trainer neither accumulates nor clips, and no pipeline schedule."""
    if module.automatic_optimization:
        return
    if strategy.pipelined:
        raise UsageError(
            "manual optimization cannot run under pipeline parallelism (manual_backward cannot drive a "
            "1F1B schedule): use automatic optimization, or pp=1"
        )
    if config.gradient_clip_val:
        raise UsageError(
            "NanoTrainer(gradient_clip_val=...) does not apply under manual optimization: call "
            "self.clip_gradients(opt, gradient_clip_val=..., gradient_clip_algorithm=...) in training_step"
        )
    if config.accumulate_grad_batches != 1:
        raise UsageError(
            "NanoTrainer(accumulate_grad_batches=...) does not apply under manual optimization: step the "
            "optimizer every N batches in training_step yourself"
        )


@contextmanager
def set_determinism(deterministic: bool | str | None, benchmark: bool | None) -> Iterator[None]:
    """``deterministic`` (True, or "warn": warn only) and cudnn ``benchmark`` for one call;
    both are process-global, so they are restored afterwards."""
    was_det, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    was_bench = torch.backends.cudnn.benchmark
    if deterministic not in (None, False, True, "warn"):
        raise UsageError(f'deterministic must be True, False, "warn" or None, got {deterministic!r}')
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=deterministic == "warn")
    if benchmark is not None:
        torch.backends.cudnn.benchmark = benchmark and not deterministic
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_det, warn_only=was_warn)
        torch.backends.cudnn.benchmark = was_bench
