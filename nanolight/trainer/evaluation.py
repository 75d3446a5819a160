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

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
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
    if trainer.inference_mode and not trainer.strategy.parallel.pipelined:
        return torch.inference_mode()
    return torch.no_grad()


@contextmanager
def _evaluating(trainer: NanoTrainer, name: str) -> Iterator[None]:
    """Eval mode (``on_*_model_eval``), ``on_*_start``, ``on_*_epoch_start``; afterwards each
    submodule's train/eval flag as it was (Lightning keeps deliberately frozen submodules in eval
    mode) or the module's ``on_*_model_train`` when it overrides it. An error propagates with the
    module left in eval mode, as Lightning leaves it."""
    module, model_hook = trainer.lightning_module, "validation" if name == "val" else name
    modes = {sub_name: sub.training for sub_name, sub in module.named_modules()}
    trainer.hooks.module(f"on_{model_hook}_model_eval")
    trainer.hooks.call(f"on_{HOOK_NAMES[name]}_start")
    trainer.hooks.call(f"on_{HOOK_NAMES[name]}_epoch_start")
    yield
    if name != "predict" and is_overridden(f"on_{model_hook}_model_train", module, NanoModule):
        trainer.hooks.module(f"on_{model_hook}_model_train")
    else:
        for sub_name, sub in module.named_modules():
            if sub_name in modes:
                sub.training = modes[sub_name]


def _limits(trainer: NanoTrainer, kind: str, loaders: list[Any], sanity: bool) -> list[int | float]:
    """Batches per dataloader, recorded as ``trainer.num_<kind>_batches``; the sanity check runs
    at most ``num_sanity_val_steps`` of them (-1: all), recorded as ``num_sanity_val_batches``."""
    limits = [trainer.data.num_batches(loader, kind) for loader in loaders]
    setattr(trainer, f"num_{kind}_batches", limits)
    if sanity:
        n = trainer.config.num_sanity_val_steps
        limits = trainer.num_sanity_val_batches = [lim if n == -1 else min(n, lim) for lim in limits]
    return limits


def _batches(trainer: NanoTrainer, name: str, loaders: list[Any], limits: list[int | float]) -> Any:
    """Each dataloader's batches up to its limit: yields (dataloader_idx, batch_idx, the step's
    output) after running transfer, ``on_<name>_batch_start``, the step and ``on_<name>_batch_end``;
    a dataloader's end is marked by a batch_idx of None."""
    multi = len(loaders) > 1
    for dl_idx, (loader, limit) in enumerate(zip(loaders, limits, strict=True)):
        trainer.metrics.dataloader_idx = dl_idx if multi and name != "predict" else None
        set_epoch(loader, trainer.current_epoch)  # every stage's loaders, as Lightning
        for batch_idx, batch in enumerate(loader):
            if batch_idx >= limit:
                break
            extra = (dl_idx,) if multi else ()
            raw, batch = batch, trainer.hooks.transfer_batch(batch, dl_idx)
            trainer.metrics.batch = batch
            trainer.hooks.call(f"on_{name}_batch_start", batch, batch_idx, *extra)
            strategy = trainer.strategy  # cp: the ranks sharing a batch's tokens share its count
            with strategy.autocast(), strategy.token_mean([raw], whole_step=False):
                out = trainer.hooks.step(f"{name}_step", batch, batch_idx, *extra)
            trainer.hooks.call(f"on_{name}_batch_end", out, batch, batch_idx, *extra)
            yield dl_idx, batch_idx, out
        yield dl_idx, None, None


def run_evaluation(
    trainer: NanoTrainer, kind: str, loaders: list[Any], sanity: bool = False
) -> list[dict[str, float]]:
    metrics, hook, name = trainer.metrics, trainer.hooks.call, HOOK_NAMES[kind]
    limits = _limits(trainer, kind, loaders, sanity)
    results = metrics.eval
    results.reset()
    metrics.active, previous_active = results, metrics.active
    per_loader: list[dict[str, torch.Tensor]] = []
    seen: set[str] = set()
    try:
        with _grad_mode(trainer), _evaluating(trainer, kind):  # the hooks too, as Lightning's loops
            for dl_idx, batch_idx, _ in _batches(trainer, name, loaders, limits):
                if batch_idx is not None:
                    step_log = metrics.publish(results, on_step=True)
                    if step_log and not sanity:  # on_step values in an evaluation: one row per batch
                        metrics.eval_batch_row(dict(step_log), dl_idx)
                    continue
                log = metrics.publish(
                    results, on_step=False, update=not sanity
                )  # this dataloader's epoch values
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
    return [{k: float(v) for k, v in out.items()} for out in per_loader]


def run_predict(trainer: NanoTrainer, loaders: list[Any], return_predictions: bool) -> list[Any] | None:
    limits = _limits(trainer, "predict", loaders, False)
    outputs: list[list[Any]] = [[] for _ in loaders]
    with _grad_mode(trainer), _evaluating(trainer, "predict"):
        for dl_idx, batch_idx, out in _batches(trainer, "predict", loaders, limits):
            if batch_idx is not None and return_predictions:
                outputs[dl_idx].append(out)
        trainer.hooks.call("on_predict_epoch_end")
        trainer.hooks.call("on_predict_end")
    if not return_predictions:
        return None
    return outputs if len(loaders) > 1 else outputs[0]
