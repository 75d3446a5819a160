"""`PipelineStage`: one rank's slice of a model, called exactly like the whole model.

The user's `training_step` keeps calling ``self.model(input_ids, labels=labels)`` once per
micro-batch. After the split (`split.py`) the model holds only this rank's modules, and its own
forward skips the absent ones (it takes ``hidden_states=`` in place of its embedding's output and
returns its last hidden state when it has no head). The stage wraps that forward on the instance
(module names, hooks and ``state_dict`` keys are untouched); a rank holds one chunk of layers, or
v of them under interleaving (`runner.py` `StageChunks`).

In a step (`run_step`) the stage runs its program (`runner.StepRun`) and hands the trainer its
part; the model call inside training_step runs the micro-batch's first chunk and returns the loss
or, where this rank cannot have it yet, a placeholder (`runner.py` says when and why).

Outside a schedule (validation, inference) each call is a plain forward through the pipeline:
every chunk in turn -- receive, compute, send -- returning the last virtual stage's output (a
placeholder on the other ranks).

A world of fake tensors and a fake process group (the dry run, `pretrain/dry_run.py`) runs this
same program once `fake_world` is called: the seam's one place. Its messages carry nothing, so the
handshake's shapes come from the caller (`p2p.py` `known_shapes`), and no value can be read, so
the first step's check of training_step's returned loss is not made.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from nanolight.parallel.pipeline.p2p import Shape, StageP2P
from nanolight.parallel.pipeline.runner import Placeholder, StageChunks, StepRun
from nanolight.parallel.pipeline.schedules import Action, forward_program, stage_program
from nanolight.parallel.pipeline.split import PipelineSplit


class PipelineStage:
    """Runs this rank's chunks of a split model (`chunks`) and talks to its neighbours (`p2p`);
    every chunk forward runs inside `compute_context()` (autocast), wherever the schedule puts it."""

    def __init__(
        self,
        chunks: StageChunks,
        p2p: StageP2P,
        compute_context: Callable[[], AbstractContextManager] = nullcontext,
    ) -> None:
        self.chunks, self.p2p, self.model = chunks, p2p, chunks.model
        self.pp_rank, self.pp_size = chunks.pp_rank, chunks.pp_size
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        self.compute_context = compute_context
        self.steps = 0
        self.values = True  # values can be read (False in a fake world: `fake_world`)
        self.run = StepRun([], 1, chunks, p2p, _nothing, compute_context, False)
        self.model.forward = self.forward  # instance attribute: nn.Module.__call__ (and its hooks) run it

    @classmethod
    def of(
        cls,
        model: nn.Module,
        split: PipelineSplit,
        ctx: Any,
        compute_context: Callable[[], AbstractContextManager] = nullcontext,
    ) -> PipelineStage:
        """This rank's stage of `model` cut by `split`, talking to its ring neighbours in `ctx`
        (a `ParallelContext`)."""
        p2p = StageP2P(*ctx.pp_ring, ctx.device, ctx.pp_p2p_group)
        return cls(StageChunks(model, split, ctx.pp_rank), p2p, compute_context)

    def fake_world(self, known_shapes: Callable[[Hashable], Shape]) -> None:
        """Run under fake tensors and a fake process group (see the module docstring):
        `known_shapes(key)` is what the previous rank sends for an exchange key."""
        self.p2p.known_shapes = known_shapes
        self.values = False

    @property
    def max_in_flight(self) -> int:
        """Most chunk activations alive at once during the current/last step."""
        return self.run.max_in_flight

    # ---- one optimizer step ------------------------------------------------------------------
    def run_step(
        self, schedule: str, n: int, before_backward: Callable[[bool], None] = lambda last: None
    ) -> Iterator[Action]:
        """One step of `schedule` over `n` micro-batches: this rank's program, yielding where the
        trainer's part is due (see the module docstring). `before_backward(last)` is told before
        every chunk backward whether it is that chunk's last of the step (the dp reduction)."""
        v = len(self.chunks.virtual_stages)
        program = stage_program(schedule, n, self.pp_size, self.pp_rank, v)
        check = self.steps == 0 and self.values  # the first step checks what training_step returned
        self.run = StepRun(program, n, self.chunks, self.p2p, before_backward, self.compute_context, check)
        self.steps += 1
        yield from self.run.steps()
        self.p2p.finish()  # every activation / gradient this stage sent has been received

    def forward(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.run.running:  # inside a step: the due micro-batch's model call
            return self.run.call(input_ids, args, kwargs)
        return self._plain_forward(input_ids, args, kwargs)  # validation / inference

    def backward(self, loss: torch.Tensor) -> None:
        """The trainer back-propagates `loss` (the due micro-batch's loss / n)."""
        self.run.backward(loss)

    # ---- outside a schedule -------------------------------------------------------------------
    def _plain_forward(self, input_ids: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """Every chunk in turn -- receive, compute, send -- nothing kept in flight: the last virtual
        stage's output, a placeholder on the other ranks."""
        program = forward_program(self.pp_size, self.pp_rank, len(self.chunks.virtual_stages))
        run = StepRun(program, 1, self.chunks, self.p2p, _nothing, self.compute_context, False)
        steps = run.steps()
        next(steps)  # (FORWARD, 0): its first chunk
        micro = run.start(input_ids, args, kwargs)
        for _ in steps:  # the rank's other chunks, if any: nothing else is yielded
            pass
        self.p2p.finish()
        return micro.loss if micro.loss is not None else Placeholder.make(input_ids.device)


def _nothing(last: bool) -> None:
    """No dp reduction to start before a chunk backward."""
