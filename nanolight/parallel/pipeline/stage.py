"""`PipelineStage`: one rank's slice of a model, called exactly like the whole model.

The user's `training_step` keeps calling ``self.model(input_ids, labels=labels)`` once per
micro-batch. After the split (`split.py`) the model holds only this rank's modules, and its own
forward skips the absent ones (it takes ``hidden_states=`` in place of its embedding's output and
returns its last hidden state when it has no head). The stage wraps that forward on the instance
(module names, hooks and ``state_dict`` keys are untouched); a rank holds one chunk of layers, or
v of them under interleaving (`runner.py` `StageChunks`).

How the trainer's walk of the schedule drives it. The strategy hands each step's stage-level
list (`schedules.stage_schedule`: chunk forwards and backwards) to `start_step` and the trainer
walks its projection (one FORWARD and one BACKWARD per micro-batch). Inside the trainer's
FORWARD i, the model call gives the stage micro-batch i's arguments; in its BACKWARD i,
`backward` gives it the loss to back-propagate. After each input the stage runs its list as far
as the inputs allow (`runner.StepRun`): with one chunk per rank that is exactly micro-batch i's
forward or backward; with v chunks it is also other micro-batches' chunks, where the interleaved
schedule places them. So the user's training_step and Lightning's hooks run once per micro-batch,
in the trainer's order, while the chunks run in the schedule's.

What the model call returns: the real loss on the rank holding the last virtual stage when that
chunk ran inside the call (always with one chunk per rank), else a placeholder that the loss and
`self.log` pass through; under interleaving the last rank's placeholder takes the loss's value
before anything reads it (see `runner.py`). training_step must therefore return (and may log)
the model's loss unchanged there: arithmetic on it inside training_step would see the zero. The
first step checks that and says so.

Outside a schedule (validation, inference) each call is a plain forward through the pipeline:
every chunk in turn -- receive, compute, send -- returning the last virtual stage's output (a
placeholder on the other ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from nanolight.parallel.pipeline.p2p import StageP2P
from nanolight.parallel.pipeline.runner import StageChunks, StepRun
from nanolight.parallel.pipeline.schedules import (
    Action,
    Run,
    forward_program,
    stage_program,
    trainer_schedule,
)
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
        self.current: int | None = None  # micro-batch index during its training_step in the schedule
        self.steps = 0
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

    @property
    def max_in_flight(self) -> int:
        """Most chunk activations alive at once during the current/last step."""
        return self.run.max_in_flight

    # ---- the trainer's inputs -----------------------------------------------------------------
    def start_step(
        self, schedule: str, n: int, before_backward: Callable[[bool], None] = lambda last: None
    ) -> list[Action]:
        """A new step of `schedule` over `n` micro-batches: the stage keeps its chunk-level list
        and returns the projection the trainer walks. `before_backward(last)` is told before
        every chunk backward whether it is that chunk's last of the step (the dp reduction)."""
        v = len(self.chunks.virtual_stages)
        program = stage_program(schedule, n, self.pp_size, self.pp_rank, v)
        check = self.steps == 0  # the first step checks what training_step returned
        self.run = StepRun(program, n, self.chunks, self.p2p, before_backward, self.compute_context, check)
        self.steps += 1
        return trainer_schedule([step.action for step in program if isinstance(step, Run)], v)

    @contextmanager
    def micro_batch(self, i: int) -> Iterator[None]:
        """Around the user's training_step for micro-batch `i` of the schedule."""
        self.current = i
        try:
            yield
        finally:
            self.current = None
        if not self.run.called(i):
            raise RuntimeError(
                f"micro-batch {i} never went through the pipelined model; under pipeline parallelism "
                "training_step must call self.model(input_ids, labels=...) once"
            )

    def forward(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        i = self.current
        if i is None:  # a plain forward (validation / inference): nothing stays in flight
            return self._plain_forward(input_ids, args, kwargs)
        if self.run.called(i):
            raise RuntimeError(
                f"training_step called the pipelined model twice for micro-batch {i}; under pipeline "
                "parallelism call self.model(...) exactly once per training_step"
            )
        return self.run.call(i, input_ids, args, kwargs)

    def backward(self, i: int, loss: torch.Tensor) -> None:
        """The trainer back-propagates `loss` (micro-batch `i`'s loss / n)."""
        if not self.run.called(i):
            raise RuntimeError(
                f"micro-batch {i} never went through the pipelined model; under pipeline parallelism "
                "training_step must call self.model(input_ids, labels=...) once"
            )
        self.run.backward(i, loss)

    def finish(self) -> None:
        """End of a step: run what is left, wait until every tensor this stage sent was received."""
        self.run.finish()
        self.p2p.finish()

    # ---- outside a schedule -------------------------------------------------------------------
    def _plain_forward(self, input_ids: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        program = forward_program(self.pp_size, self.pp_rank, len(self.chunks.virtual_stages))
        run = StepRun(program, 1, self.chunks, self.p2p, _nothing, self.compute_context, False)
        out = run.call(0, input_ids, args, kwargs)  # every chunk in turn: receive, compute, send
        self.p2p.finish()
        return out


def _nothing(last: bool) -> None:
    """No dp reduction to start before a chunk backward."""
