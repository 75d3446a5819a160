"""Evaluation (validation inside fit, the sanity check, ``validate``, ``test``) and prediction
loops, with Lightning's hooks and results.

Evaluation: eval mode (``on_*_model_eval``), ``on_*_start``, ``on_*_epoch_start``, then per
dataloader and batch: transfer, ``on_*_batch_start``, the step, ``on_*_batch_end``. At the end
the epoch values are computed *before* ``on_*_epoch_end`` (a callback there sees this pass's
metrics, and what it logs joins the same row), the row is logged (not during the sanity check),
``on_*_end``, then the module's train/eval modes are restored. Returns one dict per dataloader.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.overrides import is_overridden

from nanolight.trainer import data_position as position

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
    """Batches per dataloader (recorded as ``trainer.num_<kind>_batches``); the sanity check runs
    at most ``num_sanity_val_steps`` of them (-1: all)."""
    limits = [trainer.data.num_batches(loader, kind) for loader in loaders]
    trainer.set_num_batches(kind, limits, sanity=False)
    if sanity:
        n = trainer.config.num_sanity_val_steps
        limits = [float(lim) if n == -1 else float(min(n, lim)) for lim in limits]
        trainer.set_num_batches(kind, limits, sanity=True)
    return limits


def run_evaluation(trainer: NanoTrainer, kind: str, loaders: list[Any], sanity: bool = False) -> list[dict[str, float]]:
    module, metrics, hook = trainer.lightning_module, trainer.metrics, trainer.call_hook
    name = HOOK_NAMES[kind]
    limits = _limits(trainer, kind, loaders, sanity)
    modes = _ModuleModes(module)
    results = metrics.eval
    results.reset()
    metrics.active, previous_active = results, metrics.active
    multi = len(loaders) > 1
    per_loader: list[dict[str, torch.Tensor]] = []
    seen: set[str] = set()
    try:
        trainer.call_module_hook(f"on_{'validation' if kind == 'val' else kind}_model_eval")
        hook(f"on_{name}_start")
        hook(f"on_{name}_epoch_start")
        for dl_idx, (loader, limit) in enumerate(zip(loaders, limits, strict=True)):
            metrics.dataloader_idx = dl_idx if multi else None
            if trainer.state.fn == "fit":
                position.set_epoch(loader, trainer.current_epoch)
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= limit:
                    break
                extra = (dl_idx,) if multi else ()
                batch = trainer.transfer_batch(batch, dl_idx)
                metrics.batch = batch
                hook(f"on_{name}_batch_start", batch, batch_idx, *extra)
                with ExitStack() as stack:
                    stack.enter_context(_grad_mode(trainer))
                    stack.enter_context(trainer.strategy.autocast())
                    out = trainer.call_step(f"{name}_step", batch, batch_idx, *extra)
                hook(f"on_{name}_batch_end", out, batch, batch_idx, *extra)
                step_log = metrics.publish(results, on_step=True)
                if step_log and not sanity:  # on_step values in an evaluation: one row per batch
                    trainer.log_metrics(dict(step_log), step=trainer.eval_rows(dl_idx))
            log = metrics.publish(results, on_step=False, update=not sanity)  # this dataloader's epoch values
            per_loader.append({k: v for k, v in log.items() if k not in seen})
            seen |= set(log)
        metrics.dataloader_idx = None
        log = metrics.publish(results, on_step=False)  # before the epoch-end hooks: they read it
        hook(f"on_{name}_epoch_end")
        log = metrics.publish(results, on_step=False)
        for out in per_loader:  # what the epoch-end hooks logged belongs to every dataloader
            out.update({k: v for k, v in log.items() if k not in seen})
        if not sanity:
            trainer.log_metrics(dict(log))
        hook(f"on_{name}_end")
    finally:
        results.reset()
        metrics.active = previous_active
        train_hook = f"on_{'validation' if kind == 'val' else kind}_model_train"
        if _overrides(module, train_hook):
            trainer.call_module_hook(train_hook)
        else:
            modes.restore(module)
    return [{k: float(v) for k, v in out.items()} for out in per_loader]


def _overrides(module: Any, hook: str) -> bool:
    from nanolight.module.module import NanoModule

    return is_overridden(hook, module, NanoModule)


def run_predict(trainer: NanoTrainer, loaders: list[Any], return_predictions: bool) -> list[Any] | None:
    module, metrics, hook = trainer.lightning_module, trainer.metrics, trainer.call_hook
    limits = _limits(trainer, "predict", loaders, False)
    modes = _ModuleModes(module)
    multi = len(loaders) > 1
    outputs: list[list[Any]] = []
    try:
        trainer.call_module_hook("on_predict_model_eval")
        hook("on_predict_start")
        hook("on_predict_epoch_start")
        for dl_idx, (loader, limit) in enumerate(zip(loaders, limits, strict=True)):
            preds: list[Any] = []
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= limit:
                    break
                extra = (dl_idx,) if multi else ()
                batch = trainer.transfer_batch(batch, dl_idx)
                metrics.batch = batch
                hook("on_predict_batch_start", batch, batch_idx, *extra)
                with ExitStack() as stack:
                    stack.enter_context(_grad_mode(trainer))
                    stack.enter_context(trainer.strategy.autocast())
                    out = trainer.call_step("predict_step", batch, batch_idx, *extra)
                hook("on_predict_batch_end", out, batch, batch_idx, *extra)
                if return_predictions:
                    preds.append(out)
            outputs.append(preds)
        hook("on_predict_epoch_end")
        hook("on_predict_end")
    finally:
        modes.restore(module)
    if not return_predictions:
        return None
    return outputs if multi else outputs[0]
