"""Evaluation (validation inside fit, the sanity check, ``validate``, ``test``) and prediction
loops, with Lightning's hooks and results.

Evaluation: eval mode (``on_*_model_eval``), ``on_*_start``, ``on_*_epoch_start``, then per
dataloader and batch: transfer, ``on_*_batch_start``, the step, ``on_*_batch_end``. At the end
the epoch values are computed *before* ``on_*_epoch_end`` (a callback there sees this pass's
metrics, and what it logs joins the same row), the row is logged (not during the sanity check),
``on_*_end``, then the module's train/eval modes are restored. Returns one dict per dataloader.
Prediction runs the same batches and hooks, collecting what ``predict_step`` returns.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.overrides import is_overridden

from nanolight.module.module import NanoModule
from nanolight.trainer.data import set_epoch

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer

HOOK_NAMES = {"val": "validation", "test": "test", "predict": "predict"}


def _grad_mode(trainer: NanoTrainer) -> AbstractContextManager:
    """Lightning evaluates under inference_mode; a pipeline's exchange buffers are reused by
    training, so under pipeline parallelism plain no_grad."""
    if trainer.inference_mode and not trainer.strategy.pipelined:
        return torch.inference_mode()
    return torch.no_grad()


class _ModuleModes:
    """Each submodule's train/eval flag before evaluation, restored after (Lightning keeps
    deliberately frozen submodules in eval mode)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.modes = {name: m.training for name, m in module.named_modules()}

    def restore(self, module: torch.nn.Module) -> None:
        for name, m in module.named_modules():
            if name in self.modes:
                m.training = self.modes[name]


def _limits(trainer: NanoTrainer, kind: str, loaders: list[Any], sanity: bool) -> list[float]:
    """Batches per dataloader, recorded as ``trainer.num_<kind>_batches``; the sanity check runs
    at most ``num_sanity_val_steps`` of them (-1: all), recorded as ``num_sanity_val_batches``."""
    limits = [trainer.data.num_batches(loader, kind) for loader in loaders]
    setattr(trainer, {"val": "num_val_batches"}.get(kind, f"num_{kind}_batches"), _counts(limits))
    if sanity:
        n = trainer.config.num_sanity_val_steps
        limits = [float(lim) if n == -1 else float(min(n, lim)) for lim in limits]
        trainer.num_sanity_val_batches = _counts(limits)
    return limits


def _counts(limits: list[float]) -> list[int | float]:
    return [int(n) if n != float("inf") else n for n in limits]


def _batches(trainer: NanoTrainer, name: str, loaders: list[Any], limits: list[float]) -> Any:
    """Each dataloader's batches up to its limit: yields (dataloader_idx, batch_idx, the step's
    output) after running transfer, ``on_<name>_batch_start``, the step and ``on_<name>_batch_end``;
    a dataloader's end is marked by a batch_idx of None."""
    multi = len(loaders) > 1
    for dl_idx, (loader, limit) in enumerate(zip(loaders, limits, strict=True)):
        trainer.metrics.dataloader_idx = dl_idx if multi and name != "predict" else None
        if trainer.state.fn == "fit":
            set_epoch(loader, trainer.current_epoch)
        for batch_idx, batch in enumerate(loader):
            if batch_idx >= limit:
                break
            extra = (dl_idx,) if multi else ()
            raw, batch = batch, trainer.hooks.transfer_batch(batch, dl_idx)
            trainer.metrics.batch = batch
            trainer.hooks.call(f"on_{name}_batch_start", batch, batch_idx, *extra)
            strategy = trainer.strategy  # cp: the ranks sharing a batch's tokens share its count
            with _grad_mode(trainer), strategy.autocast(), strategy.token_mean([raw], whole_step=False):
                out = trainer.hooks.step(f"{name}_step", batch, batch_idx, *extra)
            trainer.hooks.call(f"on_{name}_batch_end", out, batch, batch_idx, *extra)
            yield dl_idx, batch_idx, out
        yield dl_idx, None, None


def run_evaluation(
    trainer: NanoTrainer, kind: str, loaders: list[Any], sanity: bool = False
) -> list[dict[str, float]]:
    module, metrics, hook = trainer.lightning_module, trainer.metrics, trainer.hooks.call
    name, model_hook = HOOK_NAMES[kind], "validation" if kind == "val" else kind
    limits = _limits(trainer, kind, loaders, sanity)
    modes = _ModuleModes(module)
    results = metrics.eval
    results.reset()
    metrics.active, previous_active = results, metrics.active
    per_loader: list[dict[str, torch.Tensor]] = []
    seen: set[str] = set()
    try:
        trainer.hooks.module(f"on_{model_hook}_model_eval")
        hook(f"on_{name}_start")
        hook(f"on_{name}_epoch_start")
        for dl_idx, batch_idx, _ in _batches(trainer, name, loaders, limits):
            if batch_idx is not None:
                step_log = metrics.publish(results, on_step=True)
                if step_log and not sanity:  # on_step values in an evaluation: one row per batch
                    metrics.eval_batch_row(dict(step_log), dl_idx)
                continue
            log = metrics.publish(results, on_step=False, update=not sanity)  # this dataloader's epoch values
            per_loader.append({k: v for k, v in log.items() if k not in seen})
            seen |= set(log)
        metrics.dataloader_idx = None
        metrics.publish(results, on_step=False)  # before the epoch-end hooks: they read it
        hook(f"on_{name}_epoch_end")
        log = metrics.publish(results, on_step=False)
        for out in per_loader:  # what the epoch-end hooks logged belongs to every dataloader
            out.update({k: v for k, v in log.items() if k not in seen})
        if not sanity:
            metrics.log_row(dict(log))
        hook(f"on_{name}_end")
    finally:
        results.reset()
        metrics.active = previous_active
        if is_overridden(f"on_{model_hook}_model_train", module, NanoModule):
            trainer.hooks.module(f"on_{model_hook}_model_train")
        else:
            modes.restore(module)
    return [{k: float(v) for k, v in out.items()} for out in per_loader]


def run_predict(trainer: NanoTrainer, loaders: list[Any], return_predictions: bool) -> list[Any] | None:
    module, hook = trainer.lightning_module, trainer.hooks.call
    limits = _limits(trainer, "predict", loaders, False)
    modes = _ModuleModes(module)
    outputs: list[list[Any]] = [[] for _ in loaders]
    try:
        trainer.hooks.module("on_predict_model_eval")
        hook("on_predict_start")
        hook("on_predict_epoch_start")
        for dl_idx, batch_idx, out in _batches(trainer, "predict", loaders, limits):
            if batch_idx is not None and return_predictions:
                outputs[dl_idx].append(out)
        hook("on_predict_epoch_end")
        hook("on_predict_end")
    finally:
        modes.restore(module)
    if not return_predictions:
        return None
    return outputs if len(loaders) > 1 else outputs[0]
