"""One optimizer step, read top to bottom: the strategy's micro-batch schedule, walked by the trainer.

The strategy says in which order this rank runs the forwards and backwards of the step's `n`
micro-batches (one after the other, or 1F1B / all-forward-all-backward under pipeline
parallelism) and what surrounds each of them; the trainer walks that list and fires Lightning's
hooks itself, in Lightning's order for automatic optimization with gradient accumulation::

    FORWARD i:  on_train_batch_start -> training_step -> (i == 0: on_before_zero_grad, zero_grad)
    BACKWARD i: on_before_backward -> backward(loss_i / n) -> on_after_backward
                -> on_train_batch_end (i < n - 1)
    then:       on_before_optimizer_step -> clip -> optimizer.step -> LR schedulers (interval "step")
                -> on_train_batch_end (the last micro-batch, after the update, as in Lightning)

``batch_idx`` counts micro-batches within the epoch; ``global_step`` counts optimizer steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nanolight.module.optimizers import step_scheduler
from nanolight.strategies.base import FORWARD
from nanolight.trainer.data_position import count_consumed

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer


def extract_loss(output: Any) -> torch.Tensor:
    """The loss tensor of a ``training_step`` output, or a TypeError/ValueError naming the problem."""
    fix = "training_step must return the scalar loss tensor (or a dict with a 'loss' entry)"
    if output is None:
        raise TypeError(
            f"training_step returned None; {fix}. Skipping a step by returning None is not supported."
        )
    if isinstance(output, dict):
        if "loss" not in output:
            raise TypeError(f"training_step returned a dict without 'loss' (keys: {sorted(output)}); {fix}")
        output = output["loss"]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"training_step returned a {type(output).__name__}; {fix}")
    if output.numel() != 1:
        raise ValueError(
            f"training_step returned a loss of shape {tuple(output.shape)}; {fix} (reduce it, e.g. loss.mean())"
        )
    return output if output.dim() == 0 else output.reshape(())


def detach_output(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, dict):
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in output.items()}
    return output


def run_step(trainer: NanoTrainer, batches: list[Any]) -> None:
    """Forward and backward every micro-batch of one optimizer step, then apply the update."""
    strategy, module, hook = trainer.strategy, trainer.lightning_module, trainer.call_hook
    batches = [strategy.batch_to_device(b) for b in batches]
    n, first = len(batches), trainer.progress["batch_idx"]
    losses: dict[int, torch.Tensor] = {}
    outputs: dict[int, Any] = {}
    for kind, i in strategy.micro_batch_schedule(n):
        if kind == FORWARD:
            hook("on_train_batch_start", batches[i], first + i)
            with strategy.forward_context(i):
                output = module.training_step(batches[i], first + i)
            losses[i], outputs[i] = extract_loss(output), detach_output(output)
            if i == 0:
                for opt in strategy.optimizers:
                    hook("on_before_zero_grad", opt)
                    strategy.zero_grad(opt)
        else:
            scaled = losses[i] / n  # the accumulated gradient equals one big batch's
            hook("on_before_backward", scaled)
            strategy.backward(scaled, i, n)
            hook("on_after_backward")
            losses[i] = losses[i].detach()
            if i < n - 1:
                hook("on_train_batch_end", outputs.pop(i), batches[i], first + i)
    strategy.finish_backward()
    trainer.progress["batch_idx"] += n
    # the step's mean loss as every rank must see it (from the last pipeline stage, over dp)
    trainer.step_loss = strategy.reduce(torch.stack([losses[i] for i in range(n)]).float().mean())
    _update(trainer)
    count_consumed(trainer.progress, batches, strategy.data_parallel_size)
    trainer.progress["global_step"] += 1
    if not trainer.skip_optimizer_step:
        for sc in trainer.lr_scheduler_configs:
            if sc.interval == "step" and trainer.global_step % sc.frequency == 0:
                step_scheduler(sc, trainer.callback_metrics)
    _log_step(trainer)
    hook("on_train_batch_end", outputs.pop(n - 1), batches[n - 1], first + n - 1)


def _update(trainer: NanoTrainer) -> None:
    """on_before_optimizer_step (a callback may veto the update: NaNGuard), clip, step."""
    strategy, clip = trainer.strategy, trainer.config.gradient_clip_val
    trainer.skip_optimizer_step = False
    for opt in strategy.optimizers:
        trainer.call_hook("on_before_optimizer_step", opt)
    if trainer.skip_optimizer_step:
        for opt in strategy.optimizers:
            strategy.zero_grad(opt)
        return
    if clip is not None:
        trainer.grad_norm = strategy.clip_gradients(clip)
    for opt in strategy.optimizers:
        strategy.optimizer_step(opt)


def _log_step(trainer: NanoTrainer) -> None:
    """This step's metrics: what training_step logged (reduced in one collective) and train/loss,
    always reported (the global-batch mean: the step loss, already reduced, unless the module
    logged its own)."""
    metrics = trainer.metrics
    sync = {"train/loss"} if metrics.has("train/loss") else set()
    if not sync:
        metrics.log("train/loss", trainer.step_loss, True, True, True, False, False)
    out = metrics.finish_step(trainer.strategy.reduce, always_sync=frozenset(sync))
    if trainer.grad_norm is not None:
        metrics.callback_metrics["grad_norm"] = trainer.grad_norm.detach()
        out["grad_norm"] = trainer.grad_norm
    if trainer.should_log:
        trainer.log_metrics({**out, "epoch": trainer.current_epoch})
