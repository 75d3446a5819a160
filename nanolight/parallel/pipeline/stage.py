"""`PipelineStage`: one rank's slice of a causal LM, called exactly like the whole model.

The user's `training_step` keeps calling `self.model(input_ids, labels=labels)`. After the
split, that call runs this stage's part of the forward (the stage replaces the model's
`forward` on the instance, so module names, hooks and `state_dict` keys are untouched):

    first stage   embed(input_ids) -> its layers -> send the activation to the next stage
    middle stage  receive the activation -> its layers -> send it on
    last stage    receive -> its layers -> norm -> lm_head -> loss (the real, scalar loss)

A non-last stage returns a *placeholder* loss: a zero scalar that is differentiable with
respect to the stage's output. The user logs it and returns it like a real loss; when the
engine later back-propagates it, the placeholder's backward hands autograd the gradient the
next stage sent for this output, so the user's `loss.backward()` path (hooks included) drives
the stage's real backward. The true loss reaches the metrics through the strategy (see
`engine.py`).

Outside a schedule (validation, `model(ids)` for inference) each call is a plain forward
through the pipeline: receive, compute, send, return (a placeholder on non-last stages).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanolight.parallel.pipeline.p2p import StageP2P

IGNORE_INDEX = -100


class _GradSlot:
    """Where the engine puts the gradient received for one micro-batch's stage output."""

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
        # The incoming 1/n scaling is already inside the received gradient (the last stage
        # back-propagated loss/n), so it is not applied twice.
        grad, ctx.slot.grad = ctx.slot.grad, None
        if grad is None:
            raise RuntimeError(
                "pipeline placeholder loss was back-propagated outside the pipeline engine; under "
                "pipeline parallelism the strategy drives backward (do not call loss.backward() yourself)"
            )
        return grad, None


@dataclass
class _InFlight:
    """One micro-batch between its forward and its backward on this stage."""

    key: Hashable
    stage_input: torch.Tensor | None  # received activation (a leaf), None on the first stage
    slot: _GradSlot


class PipelineStage:
    """Runs one stage of a split `LlamaForCausalLM` (see `split.py`) and talks to its neighbours."""

    def __init__(self, lm: nn.Module, pp_rank: int, pp_size: int, p2p: StageP2P) -> None:
        self.lm, self.p2p = lm, p2p
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        self.current: int | None = None  # micro-batch index while the engine runs its forward
        self.in_flight: dict[int, _InFlight] = {}
        lm.forward = self.forward  # instance attribute: nn.Module.__call__ (and its hooks) run it

    # ---- forward ----------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        lm, i = self.lm, self.current
        key = tuple(input_ids.shape)  # the activation shape follows from it
        if self.is_first:
            x = lm.model.embed_tokens(input_ids)  # (B, T, C)
            stage_input = None
        else:
            stage_input = self.p2p.recv_forward(key)  # (B, T, C) from the previous stage
            if torch.is_grad_enabled():
                stage_input.requires_grad_()  # a leaf: its .grad is what we send back
            x = stage_input
        cos, sin = lm.model.rotary_tables(input_ids.shape, position_ids, x)
        for layer in lm.model.layers:  # this stage's layers only, in global order
            x = layer(x, cos, sin)

        slot = _GradSlot()  # filled with d loss/d x by `backward` (unused on the last stage)
        if self.is_last:
            out = self._head_and_loss(x, labels)
        else:
            self.p2p.send_forward(x, key)  # (B, T, C) to the next stage
            out = _Placeholder.apply(x, slot)
        if i is None:  # a plain forward (validation / inference): nothing stays in flight
            self.p2p.wait()
            return out
        if i in self.in_flight:
            raise RuntimeError(
                f"training_step called the pipelined model twice for micro-batch {i}; under pipeline "
                "parallelism call self.model(...) exactly once per training_step"
            )
        self.in_flight[i] = _InFlight(key, stage_input, slot)
        return out

    def _head_and_loss(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The last stage: final norm, output head, and the model's own loss (as its forward)."""
        lm = self.lm
        logits = lm.lm_head(lm.model.norm(x))  # (B, T, V)
        if labels is None:
            return logits
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T): t predicts t+1
        return lm.loss_fn(logits, shifted)

    # ---- backward -----------------------------------------------------------------------------
    def backward(self, i: int, loss: torch.Tensor, run_backward: Any) -> None:
        """Backward of micro-batch `i`: receive d loss/d output, back-propagate, send d loss/d input.

        `run_backward(loss)` is the trainer's `micro_step.backward` (hooks + `loss.backward()`).
        """
        if i not in self.in_flight:
            raise RuntimeError(
                f"micro-batch {i} never went through the pipelined model; under pipeline parallelism "
                "training_step must call self.model(input_ids, labels=...) once"
            )
        flight = self.in_flight.pop(i)
        if not self.is_last:
            flight.slot.grad = self.p2p.recv_backward(flight.key)  # d loss/d output <- next stage
        run_backward(loss)
        if not self.is_first:
            grad = flight.stage_input.grad if flight.stage_input is not None else None
            self.p2p.send_backward(grad, flight.key)  # d loss/d input -> previous stage
