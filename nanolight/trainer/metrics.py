"""What ``self.log`` records, and how it becomes step/epoch metrics.

Training: values logged during one optimizer step are averaged over its micro-batches (so
``train/loss`` is the global-batch mean), then -- when ``sync_dist`` -- averaged over
data-parallel ranks by `Strategy.reduce` (the one path every metric and the loss take across
ranks). Validation: values are averaged over the epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _Entry:
    prog_bar: bool
    logger: bool
    on_step: bool
    on_epoch: bool
    sync_dist: bool
    values: list[torch.Tensor] = field(default_factory=list)


def _to_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"self.log({name!r}) needs a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.detach()
        return (value if value.dim() == 0 else value.reshape(())).float()
    if isinstance(value, (int, float, bool)):
        return torch.tensor(float(value))
    raise TypeError(f"self.log({name!r}) needs a number or scalar tensor, got {type(value).__name__}")


def _reduced(
    entries: dict[str, _Entry], reduce: Reduce, always: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """Each entry's mean; the ``sync_dist`` ones (and `always`) reduced over ranks together, in one
    collective, so a step costs one reduction however many metrics it logs."""
    values = {name: torch.stack(e.values).mean() for name, e in entries.items()}
    synced = [name for name, e in entries.items() if e.sync_dist or name in always]
    if synced:
        reduced = reduce(torch.stack([values[name] for name in synced]))
        values.update(zip(synced, reduced.unbind(), strict=True))
    return values


class MetricStore:
    """Collects logs by stage ("train" or "val") and hands out reduced dicts."""

    def __init__(self) -> None:
        self.stage = "train"
        self._step: dict[str, _Entry] = {}
        # per-step (train) or per-batch (val) values, kept apart: validation runs mid-epoch
        self._epoch: dict[str, dict[str, _Entry]] = {"train": {}, "val": {}}
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.progress_bar_metrics: dict[str, torch.Tensor] = {}

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool,
        logger: bool,
        on_step: bool | None,
        on_epoch: bool | None,
        sync_dist: bool,
    ) -> None:
        train = self.stage == "train"
        on_step = train if on_step is None else on_step
        on_epoch = (not train) if on_epoch is None else on_epoch
        tensor = _to_tensor(name, value)
        store = self._step if train else self._epoch["val"]
        entry = store.setdefault(name, _Entry(prog_bar, logger, on_step, on_epoch, sync_dist))
        entry.values.append(tensor)

    def has(self, name: str) -> bool:
        return name in self._step

    def finish_step(
        self, reduce: Reduce, always_sync: frozenset[str] = frozenset()
    ) -> dict[str, torch.Tensor]:
        """Close one optimizer step: the metrics for the loggers, as tensors (converting to float
        forces a device sync, so the trainer does it only on logging steps)."""
        values = _reduced(self._step, reduce, always_sync)
        out: dict[str, torch.Tensor] = {}
        for name, e in self._step.items():
            value = values[name]
            key = f"{name}_step" if e.on_step and e.on_epoch else name
            if e.on_step:
                self._publish(key, value, e)
                if key != name:
                    self.callback_metrics[name] = value
                if e.logger:
                    out[key] = value
            if e.on_epoch:
                ep = self._epoch["train"].setdefault(
                    name, _Entry(e.prog_bar, e.logger, e.on_step, True, False)
                )
                ep.values.append(value)
        self._step = {}
        return out

    def finish_epoch(self, reduce: Reduce) -> dict[str, torch.Tensor]:
        """Close a train or validation epoch: epoch means of ``on_epoch`` metrics."""
        entries = {n: e for n, e in self._epoch[self.stage].items() if e.on_epoch and e.values}
        values = _reduced(entries, reduce)
        out: dict[str, torch.Tensor] = {}
        for name, e in entries.items():
            key = f"{name}_epoch" if e.on_step and e.on_epoch else name
            self._publish(key, values[name], e)
            self.callback_metrics[name] = values[name]
            if e.logger:
                out[key] = values[name]
        self._epoch[self.stage] = {}
        return out

    def _publish(self, key: str, value: torch.Tensor, e: _Entry) -> None:
        self.callback_metrics[key] = value
        if e.prog_bar:
            self.progress_bar_metrics[key] = value
