"""Lightning's throughput over batches, for `ThroughputMonitor(batch_size_fn, ...)`: `Throughput`
(Lightning's ``lightning.fabric.utilities.throughput.Throughput``: rates over a rolling window of
cumulative counts) and `BatchRates`, which feeds it from the hooks and logs
``<stage>/time``, ``<stage>/samples``, ``<stage>/device/samples_per_sec``, ... as Lightning does:
training on logging steps once an optimizer step is done (validation time excluded), evaluation
batches at their count in the call. The clock is ``time.perf_counter``, read at each use."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn


def stage_of(trainer: Any) -> str:
    """The running stage's value (``"train"``, ``"validate"``, ...)."""
    return trainer.state.stage.value


class MonotonicWindow(list):
    """The last `maxlen` values of a count that must keep increasing (a reset timer or counter
    would give nonsense rates, so it is an error)."""

    def __init__(self, maxlen: int) -> None:
        super().__init__()
        self.maxlen = maxlen

    def append(self, x: Any) -> None:
        if self and self[-1] >= x:
            raise ValueError(f"Expected the value to increase, last: {self[-1]}, current: {x}")
        super().append(x)
        if len(self) > self.maxlen:
            del self[0]


class Throughput:
    """Totals (``time``, ``batches``, ``samples``, ``lengths``) and, once `window_size` updates
    are in, per-device rates over the window (``device/samples_per_sec``, ``device/mfu``, ...);
    with several devices also the global rates (``samples_per_sec``, ...)."""

    def __init__(
        self,
        available_flops: float | None = None,
        world_size: int = 1,
        window_size: int = 100,
        separator: str = "/",
    ) -> None:
        if world_size < 1 or window_size < 2:
            raise ValueError(
                f"Throughput needs world_size >= 1 and window_size >= 2, got {world_size}, {window_size}"
            )
        self.available_flops, self.world_size, self.separator = available_flops, world_size, separator
        self._time: MonotonicWindow = MonotonicWindow(window_size)
        self._batches: MonotonicWindow = MonotonicWindow(window_size)
        self._samples: MonotonicWindow = MonotonicWindow(window_size)
        self._lengths: MonotonicWindow = MonotonicWindow(window_size)
        self._flops: deque[float] = deque(maxlen=window_size)

    def update(
        self,
        *,
        time: float,
        batches: int,
        samples: int,
        lengths: int | None = None,
        flops: float | None = None,
    ) -> None:
        """Cumulative `time`, `batches`, `samples` (and `lengths`) per device; `flops` since the last update."""
        self._time.append(time)
        if samples < batches:
            raise ValueError(f"Expected samples ({samples}) to be greater or equal than batches ({batches})")
        self._batches.append(batches)
        self._samples.append(samples)
        if lengths is not None:
            if lengths < samples:
                raise ValueError(
                    f"Expected lengths ({lengths}) to be greater or equal than samples ({samples})"
                )
            self._lengths.append(lengths)
            if len(self._samples) != len(self._lengths):
                raise RuntimeError("lengths must be passed with every update or with none")
        if flops is not None:
            self._flops.append(flops * self.world_size)

    def compute(self) -> dict[str, int | float]:
        dev, glob = f"device{self.separator}", self.world_size > 1
        metrics: dict[str, int | float] = {
            "time": self._time[-1],
            "batches": self._batches[-1],
            "samples": self._samples[-1],
        }
        if self._lengths:
            metrics["lengths"] = self._lengths[-1]
        elapsed = self._time[-1] - self._time[0]
        if len(self._time) == self._time.maxlen:
            batches_per_sec = (self._batches[-1] - self._batches[0]) / elapsed
            samples_per_sec = (self._samples[-1] - self._samples[0]) / elapsed
            metrics[f"{dev}batches_per_sec"] = batches_per_sec
            metrics[f"{dev}samples_per_sec"] = samples_per_sec
            if glob:
                metrics["batches_per_sec"] = batches_per_sec * self.world_size
                metrics["samples_per_sec"] = samples_per_sec * self.world_size
            if len(self._lengths) == self._lengths.maxlen:
                items_per_sec = (self._lengths[-1] - self._lengths[0]) / elapsed
                metrics[f"{dev}items_per_sec"] = items_per_sec
                if glob:
                    metrics["items_per_sec"] = items_per_sec * self.world_size
        if len(self._flops) == self._flops.maxlen:
            flops_per_sec = (sum(self._flops) - self._flops[0]) / elapsed  # the window's first is before it
            if glob:
                metrics["flops_per_sec"] = flops_per_sec
            metrics[f"{dev}flops_per_sec"] = flops_per_sec / self.world_size
            if self.available_flops:
                metrics[f"{dev}mfu"] = flops_per_sec / self.world_size / self.available_flops
        return metrics

    def reset(self) -> None:
        for window in (self._time, self._batches, self._samples, self._lengths, self._flops):
            window.clear()


class BatchRates:
    """What `ThroughputMonitor` does when given a `batch_size_fn` (Lightning's arguments): one
    `Throughput` per stage, fed at every batch end, computed and logged when a row is due.
    Rank zero only, as Lightning's."""

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int],
        length_fn: Callable[[Any], int] | None,
        window_size: int,
        separator: str,
    ) -> None:
        self.batch_size_fn, self.length_fn = batch_size_fn, length_fn
        self.window = {"window_size": window_size, "separator": separator}
        self.throughputs: dict[str, Throughput] = {}
        self.t0: dict[str, float] = {}
        self.counts: dict[str, list[int]] = {}  # stage -> [batches, samples, lengths]
        self.run_batches = 0  # batches of the current evaluation run (when a row is due)
        # an evaluation row's step: the batches its loop ran over every call (Lightning's loop
        # progress `total.ready`), kept per monitor; fit-time validation is a loop of its own,
        # counted from each training epoch's start (Lightning resets it there)
        self.loop_batches: dict[tuple[str, str, int], int] = {}
        self.has_flops: bool | None = None

    def setup(self, trainer: Any, available_flops: float | None) -> None:
        stages = ["validate", "train"] if trainer.state.fn == "fit" else [stage_of(trainer)]
        for stage in stages:
            self.throughputs[stage] = Throughput(available_flops, trainer.world_size, **self.window)

    def start(self, trainer: Any) -> None:
        stage = stage_of(trainer)
        if trainer.state.fn == "fit" or stage not in self.counts:
            self.throughputs[stage].reset()
            self.counts[stage] = [0, 0, 0]
        self.t0[stage] = time.perf_counter()
        self.run_batches = 0

    @torch.inference_mode()  # in case batch_size_fn or length_fn would build a graph
    def update(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        stage = stage_of(trainer)
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # the batch's kernels must be done before the clock is read
        elapsed = time.perf_counter() - self.t0[stage]
        counts = self.counts[stage]
        if self.length_fn is not None:
            counts[2] += self.length_fn(batch)
        if self.has_flops is None:
            self.has_flops = hasattr(pl_module, "flops_per_batch")
            if not self.has_flops:
                rank_zero_warn(
                    "When using the `ThroughputMonitor`, you need to define a `flops_per_batch` attribute or "
                    f"property in {type(pl_module).__name__} to compute the FLOPs."
                )
        counts[0] += 1
        counts[1] += self.batch_size_fn(batch)
        self.run_batches += 1
        loop = self._loop(trainer)
        self.loop_batches[loop] = self.loop_batches.get(loop, 0) + 1
        self.throughputs[stage].update(
            time=elapsed,
            batches=counts[0],
            samples=counts[1],
            lengths=None if self.length_fn is None else counts[2],
            flops=pl_module.flops_per_batch if self.has_flops else None,
        )

    def log(self, trainer: Any, step: int | None = None) -> None:
        """Log the stage's metrics, prefixed ``<stage><separator>``, at `step` (training: the
        trainer's row step)."""
        throughput = self.throughputs[stage_of(trainer)]
        metrics = {
            f"{stage_of(trainer)}{throughput.separator}{k}": v for k, v in throughput.compute().items()
        }
        trainer.log_metrics(metrics, step=step)

    @staticmethod
    def _loop(trainer: Any) -> tuple[str, str, int]:
        fn = trainer.state.fn
        return getattr(fn, "value", fn), stage_of(trainer), trainer.current_epoch if fn == "fit" else 0

    def eval_row_step(self, trainer: Any) -> int:
        """The step of an evaluation row: its loop's batches so far (see `loop_batches`)."""
        return self.loop_batches[self._loop(trainer)]

    def eval_row_due(self, trainer: Any) -> bool:
        """Lightning's rule in evaluation: every `log_every_n_steps`-th batch of the run."""
        n = trainer.config.log_every_n_steps
        return n > 0 and (self.run_batches % n == 0 or trainer.should_stop)

    def exclude_validation(self) -> None:
        """Fit-time validation: move training's start on by the time from its last update to
        validation's last, so validation does not count as training time."""
        train, val = self.throughputs["train"]._time, self.throughputs["validate"]._time
        finished = self.t0["train"] + (train[-1] if train else 0.0)
        self.t0["train"] += self.t0["validate"] - finished + (val[-1] if val else 0.0)
