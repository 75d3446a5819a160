"""`MicroStep`: the trainer's per-micro-batch work, called back by `Strategy.training_step`.

Hooks fire in Lightning's order for automatic optimization with gradient accumulation: for
each micro-batch ``on_train_batch_start -> training_step -> (first micro-batch only:
on_before_zero_grad, zero_grad) -> on_before_backward -> backward -> on_after_backward ->
on_train_batch_end``; the last micro-batch's ``on_train_batch_end`` is fired by the trainer
after the optimizer step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nanolight.trainer import NanoTrainer


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
            f"training_step returned a loss of shape {tuple(output.shape)}; {fix} "
            "(reduce it, e.g. loss.mean())"
        )
    return output if output.dim() == 0 else output.reshape(())


def detach_output(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, dict):
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in output.items()}
    return output


class MicroStep:
    """Callable handed to the strategy for one optimizer step of ``n`` micro-batches."""

    def __init__(self, trainer: NanoTrainer, first_batch_idx: int, n: int) -> None:
        self.trainer = trainer
        self.first_batch_idx = first_batch_idx
        self.n = n
        self.batches: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}

    def __call__(self, batch: Any, i: int) -> torch.Tensor:
        trainer, module, strategy = self.trainer, self.trainer.lightning_module, self.trainer.strategy
        idx = self.first_batch_idx + i
        self.batches[i] = batch
        trainer._call_hook("on_train_batch_start", batch, idx)
        with strategy.autocast():
            output = module.training_step(batch, idx)
        loss = extract_loss(output)
        self.outputs[i] = detach_output(output)
        if i == 0:
            for opt in strategy.optimizers:
                trainer._call_hook("on_before_zero_grad", opt)
                strategy.zero_grad(opt)
        return loss

    def backward(self, loss: torch.Tensor, i: int) -> None:
        trainer = self.trainer
        trainer._call_hook("on_before_backward", loss)
        trainer.strategy.backward(loss)
        trainer._call_hook("on_after_backward")
        if i < self.n - 1:
            trainer._call_hook(
                "on_train_batch_end", self.outputs.pop(i), self.batches.pop(i), self.first_batch_idx + i
            )

    def finish(self) -> None:
        """After the optimizer step: the last micro-batch's ``on_train_batch_end``."""
        i = self.n - 1
        self.trainer._call_hook(
            "on_train_batch_end",
            self.outputs.pop(i, None),
            self.batches.pop(i, None),
            self.first_batch_idx + i,
        )
