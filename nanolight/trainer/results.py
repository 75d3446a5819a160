"""What ``self.log`` recorded in one loop (training, or one evaluation pass), and the values it
yields, with Lightning's semantics:

* a step value is the *last* one logged (with gradient accumulation: the last micro-batch's),
  and it stays until the loop resets (a batch that logs nothing repeats it);
* an epoch value is the mean weighted by batch size (``reduce_fx="mean"``), or the sum / max /
  min of the logged values;
* ``sync_dist`` values are reduced over data-parallel ranks through `Strategy.reduce`, all of a
  step's (or an epoch's) in one collective.

Names follow Lightning: logged with both ``on_step`` and ``on_epoch``, a metric appears as
``name_step`` and ``name_epoch`` (and ``name`` in ``callback_metrics``); with several evaluation
dataloaders, names get ``/dataloader_idx_<i>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nanolight.errors import UsageError

Reduce = Callable[[torch.Tensor, str], torch.Tensor]
REDUCE_FX = ("mean", "sum", "max", "min")


@dataclass(frozen=True)
class Meta:
    name: str  # with the dataloader suffix, if any
    prog_bar: bool
    logger: bool
    on_step: bool
    on_epoch: bool
    reduce_fx: str
    sync: bool

    def forked(self, on_step: bool) -> str:
        if self.on_step and self.on_epoch:
            return f"{self.name}_step" if on_step else f"{self.name}_epoch"
        return self.name


class _Metric:
    def __init__(self, meta: Meta) -> None:
        self.meta = meta
        self.last: torch.Tensor | None = None  # the step value
        self.last_synced = False
        self.acc: torch.Tensor | None = None  # sum(value * batch size) / sum / max / min
        self.weight: torch.Tensor | None = None  # sum of batch sizes (mean)
        self.epoch: torch.Tensor | None = None  # computed epoch value (cached until a new log)
        self.dataloader_idx: int | None = None  # the evaluation dataloader that logged it (several)

    def update(self, value: torch.Tensor, batch_size: int) -> None:
        fx = self.meta.reduce_fx
        self.last, self.last_synced, self.epoch = value, False, None
        if not self.meta.on_epoch:
            return
        if fx == "mean":
            # filled on the value's device: torch.tensor(..., device=cuda) would copy from the host and sync
            term, size = value * batch_size, torch.full((), float(batch_size), device=value.device)
            self.acc = term if self.acc is None else self.acc + term
            self.weight = size if self.weight is None else self.weight + size
        elif self.acc is None:
            self.acc = value.clone()
        elif fx == "sum":
            self.acc = self.acc + value
        else:
            self.acc = torch.maximum(self.acc, value) if fx == "max" else torch.minimum(self.acc, value)


def to_scalar_tensor(name: str, value: Any, device: torch.device | None = None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UsageError(f"self.log({name!r}) needs a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.detach().reshape(())
        return value if value.is_floating_point() else value.float()
    if isinstance(value, (bool, int, float)):
        return torch.tensor(float(value), device=device)
    raise UsageError(f"self.log({name!r}) needs a number or a scalar tensor, got {type(value).__name__}")


def reduce_fx_name(fx: Any) -> str:
    name = fx if isinstance(fx, str) else getattr(fx, "__name__", repr(fx))
    name = {"amax": "max", "amin": "min"}.get(name, name)
    if name not in REDUCE_FX:
        raise UsageError(f"self.log(reduce_fx={fx!r}): use one of {REDUCE_FX} (or torch.mean/sum/max/min)")
    return name


class Results:
    """One loop's logged metrics. `training` decides which names reach ``callback_metrics``."""

    def __init__(self, training: bool) -> None:
        self.training = training
        self.metrics: dict[str, _Metric] = {}

    def log(
        self, meta: Meta, value: torch.Tensor, batch_size: int, dataloader_idx: int | None = None
    ) -> None:
        metric = self.metrics.get(meta.name)
        if metric is None or metric.meta != meta:
            if metric is not None and metric.last is not None:
                raise UsageError(
                    f"self.log({meta.name!r}) was called with different arguments in one loop "
                    f"(before: {_args(metric.meta)}, now: {_args(meta)}); log each name one way"
                )
            metric = self.metrics[meta.name] = _Metric(meta)
        metric.update(value, batch_size)
        metric.dataloader_idx = dataloader_idx

    def sync_step(self, reduce: Reduce) -> None:
        """Reduce the unsynced ``sync_dist`` step values over ranks, in one collective."""
        todo = [m for m in self.metrics.values() if m.meta.sync and m.meta.on_step and not m.last_synced]
        for op in REDUCE_FX:
            group = [m for m in todo if _step_op(m.meta.reduce_fx) == op]
            if group:
                out = reduce(torch.stack([m.last.float() for m in group]), op)  # type: ignore[union-attr]
                for m, v in zip(group, out.unbind(), strict=True):
                    m.last, m.last_synced = v, True

    def compute_epoch(self, reduce: Reduce) -> None:
        """Epoch values of the on_epoch metrics not computed yet (``sync_dist`` ones in one
        collective per reduction kind)."""
        todo = [m for m in self.metrics.values() if m.meta.on_epoch and m.epoch is None and m.acc is not None]
        local = [m for m in todo if not m.meta.sync]
        for m in local:
            m.epoch = m.acc / m.weight if m.meta.reduce_fx == "mean" else m.acc  # type: ignore[operator]
        synced = [m for m in todo if m.meta.sync]
        means = [m for m in synced if m.meta.reduce_fx == "mean"]
        if means:  # the global weighted mean: sums of value*size and of sizes, over ranks
            flat = reduce(torch.stack([t for m in means for t in (m.acc, m.weight)]).float(), "sum")
            for k, m in enumerate(means):
                m.epoch = flat[2 * k] / flat[2 * k + 1]
        for op in ("sum", "max", "min"):
            group = [m for m in synced if m.meta.reduce_fx == op]
            if group:
                out = reduce(torch.stack([m.acc.float() for m in group]), op)  # type: ignore[union-attr]
                for m, v in zip(group, out.unbind(), strict=True):
                    m.epoch = v

    def values(
        self, on_step: bool, dataloader_idx: int | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(for the loggers, for callback_metrics, for the progress bar), as Lightning's
        ``_ResultCollection.metrics``: step values when `on_step` (only `dataloader_idx`'s while
        one of several evaluation loaders runs), else epoch values."""
        log: dict[str, torch.Tensor] = {}
        callback: dict[str, torch.Tensor] = {}
        pbar: dict[str, torch.Tensor] = {}
        for m in self.metrics.values():
            other_loader = (
                None not in (dataloader_idx, m.dataloader_idx) and m.dataloader_idx != dataloader_idx
            )
            value = m.last if on_step and m.meta.on_step and not other_loader else None
            if not on_step and m.meta.on_epoch:
                value = m.epoch
            if value is None:
                continue
            forked = m.meta.forked(on_step)
            if m.meta.logger:
                log[forked] = value
            # an epoch value is a callback metric while its own loader's (or, unsplit, the epoch's) are read
            if self.training or (m.meta.on_epoch and not on_step and m.dataloader_idx == dataloader_idx):
                callback[m.meta.name] = value
                callback[forked] = value
            if m.meta.prog_bar:
                pbar[forked] = value
        return log, callback, pbar

    def reset(self) -> None:
        self.metrics = {}


def _step_op(fx: str) -> str:
    """A synced step value is averaged over ranks for a mean, else reduced with its own op."""
    return "mean" if fx == "mean" else fx


def _args(meta: Meta) -> str:
    return (
        f"on_step={meta.on_step}, on_epoch={meta.on_epoch}, reduce_fx={meta.reduce_fx!r}, "
        f"sync_dist={meta.sync}, prog_bar={meta.prog_bar}, logger={meta.logger}"
    )
