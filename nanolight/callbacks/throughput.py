"""`ThroughputMonitor`: tokens/s, samples/s, TFLOP/s per device and MFU, timed by `StepTimer`
(which `+parallel=auto`'s prediction check shares).

Tokens are counted by the trainer (``input_ids.numel()`` of every micro-batch x data-parallel
size, see ``trainer.progress``). FLOPs per token come from ``module.flops_per_token()`` (the
model owns that arithmetic) or the constructor. MFU needs the device's peak: the planner's table
(`planner/hardware.py`, one table for both) by CUDA device name and precision, or given as
``peak_flops``; on CPU or a GPU the table lacks, MFU is omitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from nanolight.callbacks.base import Callback
from nanolight.callbacks.batch_throughput import BatchRates
from nanolight.planner.hardware import HARDWARE, table_name


def lookup_peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of ``device`` at ``precision`` (None if unknown, e.g. CPU). As Lightning's
    ThroughputMonitor: ``32-true`` counts TF32's peak while fp32 matmuls may use TF32
    (``torch.get_float32_matmul_precision() != "highest"``, nanolight's default on CUDA), plain
    fp32's otherwise; every bf16 mode counts bf16's."""
    if device.type != "cuda":
        return None
    name = table_name(torch.cuda.get_device_name(device))
    if name is None:
        return None
    hw = HARDWARE[name]
    if precision.startswith("bf16"):
        return hw.bf16_flops
    return hw.fp32_flops if torch.get_float32_matmul_precision() != "highest" else hw.ieee_fp32_flops


class StepTimer(Callback):
    """Training time over the optimizer steps between logging steps, validation excluded.

    The device is synchronised only on logging steps (a step's kernels must finish before its
    time is read), so the steps between cost no sync. Subclasses receive each interval in
    `on_timed`: its seconds and how many optimizer steps it held."""

    def __init__(self) -> None:
        self._t0: float | None = None
        self._step = 0  # the global step last measured
        self._excluded = 0.0  # seconds spent in validation since the last mark
        self._val_t0: float | None = None

    def on_timed(self, trainer: Any, seconds: float, steps: int) -> None: ...

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._mark(trainer)

    def _mark(self, trainer: Any) -> None:
        self._step, self._t0, self._excluded = trainer.global_step, time.perf_counter(), 0.0

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # `trainer.progress["batch_idx"]` is one past the window's last batch: only that one (the
        # micro-batch after the update) ends a step; the earlier ones of a logging step must not time it
        window_end = batch_idx == trainer.progress["batch_idx"] - 1
        if self._t0 is None or not window_end or trainer.global_step == self._step or not trainer.should_log:
            return  # not started, a micro-batch before this step's update, or not a logging step
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # only on logging steps: timings need finished kernels
        seconds = max(time.perf_counter() - self._t0 - self._excluded, 1e-9)
        self.on_timed(trainer, seconds, trainer.global_step - self._step)
        self._mark(trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._val_t0 is not None:  # validation time is not training time
            self._excluded += time.perf_counter() - self._val_t0
            self._val_t0 = None


class ThroughputMonitor(StepTimer):
    """Two ways, by the arguments:

    - nanolight's (no `batch_size_fn`): ``throughput/{tokens,samples}_per_sec``,
      ``throughput/tflops_per_device`` and ``throughput/mfu`` on logging steps, averaged over the
      steps since the previous log, from the trainer's token count and ``flops_per_token``.
    - Lightning's (``ThroughputMonitor(batch_size_fn, length_fn=None, window_size=100,
      separator="/")``): ``train/samples``, ``train/device/samples_per_sec``, ``validate/...``,
      ``test/...`` over a rolling window of batches, FLOPs from the module's ``flops_per_batch``
      (`batch_throughput.py`).
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int] | None = None,
        length_fn: Callable[[Any], int] | None = None,
        *,
        window_size: int = 100,
        separator: str = "/",
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        super().__init__()
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._tokens0 = self._samples0 = 0
        self.rates = (
            None if batch_size_fn is None else BatchRates(batch_size_fn, length_fn, window_size, separator)
        )

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.rates is not None:
            device, mode = trainer.strategy.root_device, trainer.strategy.precision.mode
            self.rates.setup(trainer, self.peak_flops or lookup_peak_flops(device, mode))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.rates is not None:
            if trainer.is_global_zero:
                self.rates.start(trainer)
            return
        if self.flops_per_token is None and callable(getattr(pl_module, "flops_per_token", None)):
            self.flops_per_token = float(pl_module.flops_per_token())
        if self.peak_flops is None:
            self.peak_flops = lookup_peak_flops(trainer.strategy.root_device, trainer.strategy.precision.mode)
        super().on_train_start(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.rates is None:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not trainer.is_global_zero:
            return
        self.rates.update(trainer, pl_module, batch)
        stepped = (batch_idx + 1) % trainer.config.accumulate_grad_batches == 0 or trainer.is_last_batch
        if stepped and trainer.should_log:  # the window's optimizer step is done: its time counts
            self.rates.log(trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.rates is None:
            return super().on_validation_start(trainer, pl_module)
        if trainer.is_global_zero and not trainer.sanity_checking:
            self.rates.start(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.rates is None:
            return super().on_validation_end(trainer, pl_module)
        if trainer.is_global_zero and not trainer.sanity_checking and trainer.state.fn == "fit":
            self.rates.exclude_validation()

    def _eval_batch_end(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        if self.rates is not None and trainer.is_global_zero and not trainer.sanity_checking:
            self.rates.update(trainer, pl_module, batch)
            if self.rates.eval_row_due(trainer):
                self.rates.log(trainer, step=self.rates.eval_row_step(trainer))

    def on_validation_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, *_: Any
    ) -> None:
        self._eval_batch_end(trainer, pl_module, batch)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        if self.rates is not None and trainer.is_global_zero:
            self.rates.start(trainer)

    def on_test_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, *_: Any) -> None:
        self._eval_batch_end(trainer, pl_module, batch)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        if self.rates is not None and trainer.is_global_zero:
            self.rates.start(trainer)

    def on_predict_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, *_: Any) -> None:
        self._eval_batch_end(trainer, pl_module, batch)

    def _mark(self, trainer: Any) -> None:
        super()._mark(trainer)
        self._tokens0, self._samples0 = trainer.progress["tokens"], trainer.progress["samples"]

    def on_timed(self, trainer: Any, seconds: float, steps: int) -> None:
        tokens = trainer.progress["tokens"] - self._tokens0
        metrics = {"throughput/samples_per_sec": (trainer.progress["samples"] - self._samples0) / seconds}
        if tokens:
            metrics["throughput/tokens_per_sec"] = tokens / seconds
            if self.flops_per_token:
                per_device = tokens / seconds * self.flops_per_token / trainer.world_size
                metrics["throughput/tflops_per_device"] = per_device / 1e12
                if self.peak_flops:
                    metrics["throughput/mfu"] = per_device / self.peak_flops
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        trainer.log_metrics(metrics)
