"""One optimizer step, the trainer's part: under automatic optimization the strategy runs the
step's schedule (`Strategy.run_step`) and the trainer calls training_step and the backward hooks
where it yields; under manual optimization one batch. The order, told once, is ARCHITECTURE.md's
"How one optimizer step flows".

Why the closure: the last micro-batch's forward is where Lightning enters ``optimizer_step``, and
its closure runs the rest of the schedule, so a module that overrides ``optimizer_step`` still
wraps the whole update. The loss arithmetic is Lightning's (loss_i / accumulate; the step's loss
the mean of its micro-batches' over dp); inside ``strategy.token_mean`` the causal LM divides each
micro-batch's token sum by the step's count so that this arithmetic yields the exact token mean.
``batch_idx`` counts batches (micro-batches) within the epoch; ``global_step`` optimizer steps.
A ``training_step`` that returns None skips that backward (the step still happens).

Manual optimization (``automatic_optimization = False``): the module's ``training_step`` drives
its optimizers -- ``self.optimizers()``, ``self.manual_backward(loss)`` (backward hooks included),
``opt.step()`` (the gradients are finished, ``on_before_optimizer_step`` runs, ``global_step``
counts it), ``opt.zero_grad()``, and its own schedulers. As in Lightning the trainer neither
zeroes, clips nor steps anything itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from nanolight.errors import UsageError
from nanolight.strategies.base import FORWARD, Strategy
from nanolight.trainer.data import count_consumed

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer

END_EPOCH = -1  # what on_train_batch_start returns to end the epoch
EPOCH_ENDED = object()  # start_batch's answer when it did


def refuse_under_pipeline(strategy: Strategy, message: str) -> None:
    """Under pipeline parallelism every stage runs every micro-batch of the strategy's schedule
    (only the last stage has the loss, 1F1B interleaves the micro-batches): nothing may skip
    one, end the window early, or drive the schedule by hand."""
    if strategy.parallel.pipelined:
        raise UsageError(message)


def extract_loss(output: Any) -> torch.Tensor | None:
    """The loss tensor of a ``training_step`` output (None: skip), or an error naming the problem."""
    fix = "training_step must return the scalar loss tensor, a dict with a 'loss' entry, or None"
    if output is None:
        return None
    if isinstance(output, dict):
        if "loss" not in output:
            raise UsageError(f"training_step returned a dict without 'loss' (keys: {sorted(output)}); {fix}")
        output = output["loss"]
    if not isinstance(output, torch.Tensor):
        raise UsageError(f"training_step returned a {type(output).__name__}; {fix}")
    if output.numel() != 1:
        raise UsageError(
            f"training_step returned a loss of shape {tuple(output.shape)}; {fix} (e.g. loss.mean())"
        )
    return output if output.dim() == 0 else output.reshape(())


def batch_outputs(output: Any) -> dict[str, Any]:
    """What on_train_batch_end receives: Lightning's ``{"loss": ..., **extras}``, detached (a bare
    loss becomes ``{"loss": loss}``, anything else ``{}``)."""
    if isinstance(output, torch.Tensor):
        return {"loss": output.detach()}
    if isinstance(output, dict):
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in output.items()}
    return {}


class AutomaticStep:
    """Runs one optimizer step over `batches` (see the module docstring)."""

    def __init__(self, trainer: NanoTrainer) -> None:
        self.trainer = trainer

    def run(self, batches: list[Any], first: int, last_of_epoch: bool) -> bool:
        """Returns False when ``on_train_batch_start`` ended the epoch (nothing was stepped)."""
        trainer = self.trainer
        strategy, n = trainer.strategy, len(batches)
        self.losses: dict[int, torch.Tensor | None] = {}
        self.outputs: dict[int, dict[str, Any]] = {}
        self.batches: dict[int, Any] = {}
        with strategy.token_mean(batches):  # the causal LM's loss: the exact token mean of the step
            if not self._walk(strategy.run_step(n), batches, first):
                return False
        count_consumed(trainer.progress, batches, strategy.parallel.dp)
        trainer.optimization.after_optimizer_step(last_of_epoch)
        trainer.hooks.call("on_train_batch_end", self.outputs.pop(n - 1), self.batches[n - 1], first + n - 1)
        return True

    def _walk(self, actions: Iterator[tuple[str, int]], batches: list[Any], first: int) -> bool:
        """The schedule up to and including the optimizer step; False if the epoch was ended."""
        trainer = self.trainer
        hooks, n, epoch = trainer.hooks, len(batches), trainer.current_epoch
        for kind, i in actions:
            if kind != FORWARD:
                self._backward(i, n, first)
                continue
            self.batches[i] = batch = start_batch(trainer, batches[i], first + i)
            if batch is EPOCH_ENDED:
                refuse_under_pipeline(
                    trainer.strategy,
                    "on_train_batch_start returned -1 under pipeline parallelism: stop with trainer.should_stop",
                )
                return False
            if i < n - 1:
                self._forward(i, first)
                continue
            closure = _Closure(lambda: self._finish(actions, n, first))
            opt = trainer.nano_optimizers[0]
            hooks.module("optimizer_step", epoch, first + i, opt, closure)
            if not closure.ran:
                raise UsageError(
                    "optimizer_step did not run its optimizer_closure: call optimizer.step(closure=optimizer_closure)"
                )
            break
        return True

    def _forward(self, i: int, first: int) -> None:
        trainer = self.trainer
        with trainer.strategy.autocast():
            output = trainer.hooks.step("training_step", self.batches[i], first + i)
        loss = extract_loss(output)
        if loss is None:
            rank_zero_warn("training_step returned None: this batch is skipped (no backward)")
            refuse_under_pipeline(
                trainer.strategy,
                "training_step returned None under pipeline parallelism: every stage must run every micro-batch",
            )
        self.losses[i] = loss
        self.outputs[i] = {} if loss is None else {**batch_outputs(output), "loss": loss.detach()}
        if i == 0:  # Lightning zeroes after the window's first forward, before its backward
            for raw, opt in zip(trainer.optimizers, trainer.nano_optimizers, strict=True):
                trainer.hooks.call("on_before_zero_grad", raw)
                trainer.hooks.module("optimizer_zero_grad", trainer.current_epoch, first + i, opt)

    def _backward(self, i: int, n: int, first: int) -> None:
        trainer = self.trainer
        loss = self.losses[i]
        if loss is not None:
            trainer.optimization.backward(loss / trainer.config.accumulate_grad_batches)
            self.losses[i] = loss.detach()
        if i < n - 1:
            trainer.metrics.batch = self.batches[i]
            trainer.hooks.call("on_train_batch_end", self.outputs.pop(i), self.batches[i], first + i)
            trainer.metrics.publish_step(sync=False)

    def _finish(self, rest: Iterator[tuple[str, int]], n: int, first: int) -> torch.Tensor:
        """The closure: the last training_step, the remaining schedule, final gradients, the
        step's loss (`trainer.step_loss`), on_before_optimizer_step and clipping."""
        trainer = self.trainer
        self._forward(n - 1, first)
        for _, i in rest:
            self._backward(i, n, first)
        trainer.strategy.finish_backward()
        trainer.step_loss = self._step_loss()
        trainer.optimization.before_optimizer_step(trainer.optimizers[0])
        return trainer.step_loss

    def _step_loss(self) -> torch.Tensor:
        """The mean loss of the step's micro-batches (the skipped ones left out), over dp ranks."""
        device = self.trainer.strategy.root_device
        done = [loss.float() for loss in self.losses.values() if loss is not None]
        local = torch.stack(done).sum() if done else torch.zeros((), device=device)
        count = torch.full((), float(len(done)), device=device)  # filled there: no host-to-device copy
        # the last pipeline stage's (sum, count), summed over dp replicas
        total = self.trainer.strategy.reduce(torch.stack([local.to(device), count]), "sum")
        return total[0] / total[1]


class _Closure:
    """``optimizer_closure``: runs once, returns the step's loss (what torch optimizers expect)."""

    def __init__(self, fn: Callable[[], torch.Tensor | None]) -> None:
        self.fn, self.ran = fn, False
        self.loss: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor | None:
        if not self.ran:
            self.ran = True
            self.loss = self.fn()
        return self.loss


def start_batch(trainer: NanoTrainer, raw: Any, batch_idx: int) -> Any:
    """Batch transfer, then ``on_train_batch_start``; `EPOCH_ENDED` when that hook ended the epoch
    (a batch may itself be None: a collate_fn's way to hand training_step nothing)."""
    batch = trainer.hooks.transfer_batch(raw)
    trainer.metrics.batch, trainer.fit_loop.batch_idx = batch, batch_idx
    ended = trainer.hooks.call("on_train_batch_start", batch, batch_idx, returns=True) == END_EPOCH
    return EPOCH_ENDED if ended else batch


class ManualStep:
    """Runs one batch under manual optimization (see the module docstring)."""

    def __init__(self, trainer: NanoTrainer) -> None:
        self.trainer = trainer

    def run(self, batches: list[Any], first: int, last_of_epoch: bool) -> bool:
        trainer, hooks = self.trainer, self.trainer.hooks
        (raw,) = batches
        batch = start_batch(trainer, raw, first)
        if batch is EPOCH_ENDED:
            return False
        with trainer.strategy.autocast():
            output = hooks.step("training_step", batch, first)
        count_consumed(trainer.progress, batches, trainer.strategy.parallel.dp)
        trainer.metrics.publish_step(sync=True)
        hooks.call("on_train_batch_end", batch_outputs(output), batch, first)
        return True
