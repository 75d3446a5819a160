"""`PipelineStage`: one rank's slice of a model, called exactly like the whole model.

The user's `training_step` keeps calling ``self.model(input_ids, labels=labels)``. After the split
(`split.py`) the model holds only this stage's modules, and its own forward skips the absent ones
(it takes ``hidden_states=`` in place of its embedding's output and returns its last hidden state
when it has no head). The stage wraps that forward on the instance (module names, hooks and
``state_dict`` keys are untouched) and adds the exchange with the neighbours:

    first stage   forward(input_ids)                        -> send the activation to the next stage
    middle stage  receive -> forward(..., hidden_states=x)  -> send it on
    last stage    receive -> forward(..., hidden_states=x)  -> the model's own loss (or logits)

A non-last stage returns a *placeholder* loss: a zero scalar that is differentiable with respect
to the stage's output. The user logs it and returns it like a real loss; when the strategy later
back-propagates it (`backward`), the placeholder's backward hands autograd the gradient the next
stage sent for this output. The true loss reaches the metrics through `Strategy.reduce`, which
takes it from the last stage.

Which micro-batch a forward belongs to is set by the strategy around the user's training_step
(`micro_batch`); outside a schedule (validation, inference) each call is a plain forward
through the pipeline: receive, compute, send, return (a placeholder on non-last stages).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanolight.parallel.pipeline.p2p import StageP2P


class _GradSlot:
    """Where `backward` puts the gradient received for one micro-batch's stage output."""

    grad: torch.Tensor | None = None


class _Placeholder(torch.autograd.Function):
    """Zero scalar standing in for the loss on a non-last stage; its backward returns the
    gradient of the real loss w.r.t. this stage's output, received from the next stage."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, slot: _GradSlot) -> torch.Tensor:
        ctx.slot = slot
        return torch.zeros((), dtype=torch.float32, device=output.device)

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # The 1/n scaling is already inside the received gradient (the last stage
        # back-propagated loss/n), so it is not applied twice.
        grad, ctx.slot.grad = ctx.slot.grad, None
        if grad is None:
            raise RuntimeError(
                "pipeline placeholder loss was back-propagated outside the pipeline schedule; under "
                "pipeline parallelism the trainer drives backward (do not call loss.backward() yourself)"
            )
        return grad, None


@dataclass
class _InFlight:
    """One micro-batch between its forward and its backward on this stage."""

    key: Hashable
    stage_input: torch.Tensor | None  # received activation (a leaf), None on the first stage
    slot: _GradSlot


class PipelineStage:
    """Runs this rank's stage of a split model (see `split.py`) and talks to its neighbours."""

    def __init__(self, model: nn.Module, pp_rank: int, pp_size: int, p2p: StageP2P) -> None:
        self.model, self.p2p = model, p2p
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        self.current: int | None = None  # micro-batch index during its forward in the schedule
        self.in_flight: dict[int, _InFlight] = {}
        self.max_in_flight = 0  # most micro-batches alive at once during the current/last step
        self._forward = type(model).forward.__get__(model)  # the model's own, stage-skipping forward
        model.forward = self.forward  # instance attribute: nn.Module.__call__ (and its hooks) run it

    @contextmanager
    def micro_batch(self, i: int) -> Iterator[None]:
        """Around the user's training_step for micro-batch `i` of the schedule."""
        if i == 0:  # every schedule starts a step with micro-batch 0's forward
            self.max_in_flight = 0
        self.current = i
        try:
            yield
        finally:
            self.current = None

    def forward(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        key = tuple(input_ids.shape)  # the activation shape follows from it
        stage_input = None
        if not self.is_first:
            stage_input = self.p2p.recv_forward(key)  # (B, T, C) from the previous stage
            if torch.is_grad_enabled():
                stage_input.requires_grad_()  # a leaf: its .grad is what we send back
            kwargs["hidden_states"] = stage_input
        out = self._forward(input_ids, *args, **kwargs)
        slot = _GradSlot()  # filled with d loss/d out by `backward` (unused on the last stage)
        if not self.is_last:
            self.p2p.send_forward(out, key)  # (B, T, C) to the next stage
            out = _Placeholder.apply(out, slot)
        i = self.current
        if i is None:  # a plain forward (validation / inference): nothing stays in flight
            self.p2p.wait()
            return out
        if i in self.in_flight:
            raise RuntimeError(
                f"training_step called the pipelined model twice for micro-batch {i}; under pipeline "
                "parallelism call self.model(...) exactly once per training_step"
            )
        self.in_flight[i] = _InFlight(key, stage_input, slot)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        return out

    def backward(self, i: int, loss: torch.Tensor) -> None:
        """Backward of micro-batch `i`: receive d loss/d output, back-propagate, send d loss/d input."""
        if i not in self.in_flight:
            raise RuntimeError(
                f"micro-batch {i} never went through the pipelined model; under pipeline parallelism "
                "training_step must call self.model(input_ids, labels=...) once"
            )
        flight = self.in_flight.pop(i)
        if not self.is_last:
            flight.slot.grad = self.p2p.recv_backward(flight.key)  # d loss/d output <- next stage
        loss.backward()
        if not self.is_first:
            grad = flight.stage_input.grad if flight.stage_input is not None else None
            self.p2p.send_backward(grad, flight.key)  # d loss/d input -> previous stage

    def finish(self) -> None:
        """End of a step: wait until every activation/gradient this stage sent was received."""
        self.p2p.wait()
