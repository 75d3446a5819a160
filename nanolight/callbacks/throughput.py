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
from typing import Any

import torch

from nanolight.callbacks.base import Callback
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
        if self._t0 is None or trainer.global_step == self._step or not trainer.should_log:
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
    """Logs ``throughput/{tokens,samples}_per_sec``, ``throughput/tflops_per_device`` and
    ``throughput/mfu`` on logging steps, averaged over the steps since the previous log."""

    def __init__(self, flops_per_token: float | None = None, peak_flops: float | None = None) -> None:
        super().__init__()
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._tokens0 = self._samples0 = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.flops_per_token is None and callable(getattr(pl_module, "flops_per_token", None)):
            self.flops_per_token = float(pl_module.flops_per_token())
        if self.peak_flops is None:
            self.peak_flops = lookup_peak_flops(trainer.strategy.root_device, trainer.strategy.precision.mode)
        super().on_train_start(trainer, pl_module)

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
