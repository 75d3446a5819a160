"""`StepRun`: one optimizer step of a pipeline stage -- its program, run as far as the trainer's
inputs allow.

The program (`schedules.stage_program`) is the stage's chunk forwards and backwards with the
plan's exchanges between them. Two kinds of action wait for the trainer: micro-batch i's first
chunk forward needs the arguments of its model call (`call`), its first chunk backward the loss
the trainer back-propagates (`backward`). After each input `advance` runs the program up to the
next action still waiting (or to its end):

    exchange        post one batch: the outputs computed for it, the receives of later actions
    chunk forward   wait for the activation (not on virtual stage 0) -> the chunk -> its output
                    kept for the next exchange (on the last virtual stage: the loss, or logits)
    chunk backward  wait for d loss / d output (not on the last virtual stage) -> autograd ->
                    d loss / d input kept for the next exchange (not on virtual stage 0)

A receive is posted when its sender computes it (the plan's time) and waited for when its action
runs, so transfers overlap compute. Its shape must be known when it is posted, often before its
micro-batch's model call on this rank: the step's activations take the shape of micro-batch 0's
(its call comes before any exchange on every rank), and a later micro-batch of another shape is
an error.

The loss. The model call returns the real loss when the last virtual stage ran inside it
(always with one chunk per rank); otherwise a *placeholder* -- a zero scalar whose backward
leaves d(trainer's loss)/d(loss) (= 1/n) in a slot -- and the stage back-propagates the real loss
with that gradient. On a rank without the last virtual stage the placeholder stays zero (the true
loss reaches the metrics through `Strategy.reduce`, from the last stage). On the last rank under
interleaving the micro-batch reaches the last chunk only after later micro-batches' model calls,
so the placeholder takes the loss's value in place when it does: before the trainer divides it
by n, back-propagates it, reduces the step loss or reduces what `self.log` kept of it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nanolight.errors import UsageError
from nanolight.parallel.pipeline.p2p import Recv, StageP2P
from nanolight.parallel.pipeline.schedules import BACKWARD, FORWARD, Exchange, Message, Run, Step
from nanolight.parallel.pipeline.split import PipelineSplit, StageLayers

# ---- one chunk of a stage through the model's own forward ------------------------------------
#
# `StageChunks`: run one of a rank's v chunks (virtual stages) through the model's own forward.
#
# After `apply_split` the model holds all of this rank's layers (v non-adjacent runs under
# interleaving), and its forward runs every layer it holds, then its head if it has one. A chunk
# forward must run only that chunk's run of layers, and the head only in the model's last chunk.
# `only(c)` makes the model look like chunk c for the duration of one forward -- the blocks module
# swapped for the chunk's (the same layer objects), the "last" modules hidden outside the last
# chunk -- and puts everything back afterwards, through the public `set_submodule` / attribute
# API. Nothing is copied; parameter names and ``state_dict`` keys are the model's own whenever
# no chunk forward is running, and autograd keeps what each forward needs for its backward.
# The "first" modules need no hiding: a chunk after the first is given ``hidden_states``, which
# the model's forward takes in place of its embedding's output.
#
# With one chunk per rank (v = 1) nothing is swapped.


class StageChunks:
    """Rank `stage`'s chunks of `model` (already cut by `apply_split` with `split`)."""

    def __init__(self, model: nn.Module, split: PipelineSplit, stage: int) -> None:
        self.model, self.split = model, split
        self._forward = type(model).forward.__get__(model)  # the model's own, stage-skipping forward
        self.pp_rank, self.pp_size = stage, split.pp_size
        self.virtual_stages = split.chunks(stage)  # global chunk index of each local chunk
        self.num_chunks = len(split.ranges)
        held = model.get_submodule(split.layers)
        self._all = held
        self._runs = [
            StageLayers({str(i): held[str(i)] for i in split.ranges[g]}) for g in self.virtual_stages
        ]
        last = [(name, model.get_submodule(name)) for name in split.last if split.keeps(stage, name)]
        self._last = last  # the head etc., present on the last rank only

    def is_first(self, chunk: int) -> bool:
        """Local chunk `chunk` is virtual stage 0 (it takes the token ids, no activation)."""
        return self.virtual_stages[chunk] == 0

    def is_last(self, chunk: int) -> bool:
        """Local chunk `chunk` is the model's last virtual stage (it returns the loss or logits)."""
        return self.virtual_stages[chunk] == self.num_chunks - 1

    def forward(self, chunk: int, input_ids: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        """Local chunk `chunk`'s forward: the model's own, on the chunk's layers."""
        with self.only(chunk):
            return self._forward(input_ids, *args, **kwargs)

    @contextmanager
    def only(self, chunk: int) -> Iterator[None]:
        """The model runs local chunk `chunk` alone while inside."""
        if len(self._runs) == 1:
            yield
            return
        hidden = [] if self.is_last(chunk) else self._last
        self.model.set_submodule(self.split.layers, self._runs[chunk])
        for name, _ in hidden:
            _set(self.model, name, None)
        try:
            yield
        finally:
            self.model.set_submodule(self.split.layers, self._all)
            for name, module in hidden:
                _set(self.model, name, module)


def _set(model: nn.Module, name: str, module: nn.Module | None) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


class GradSlot:
    """Where a placeholder's backward leaves d(trainer's loss)/d(loss)."""

    grad: torch.Tensor | None = None


class Placeholder(torch.autograd.Function):
    """Zero scalar standing in for a loss the model call cannot return (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, slot: GradSlot) -> torch.Tensor:
        ctx.slot = slot
        return torch.zeros((), dtype=torch.float32, device=anchor.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.slot.grad = grad
        return None, None

    @classmethod
    def make(cls, device: torch.device, slot: GradSlot | None = None) -> torch.Tensor:
        anchor = torch.zeros((), device=device, requires_grad=torch.is_grad_enabled())
        return cls.apply(anchor, slot or GradSlot())


@dataclass
class _Micro:
    """One micro-batch of the step, from its model call to its last chunk backward."""

    call: tuple[torch.Tensor, tuple, dict]  # the model call's (input_ids, args, kwargs)
    grad_enabled: bool
    placeholder: torch.Tensor | None = None  # what the call returned, when not the real loss
    slot: GradSlot = field(default_factory=GradSlot)
    loss: torch.Tensor | None = None  # the last virtual stage's output (last rank only)
    seed: torch.Tensor | None = None  # the trainer's loss_i / n, from `backward`


class StepRun:
    """Stage `chunks`'s `program` (`schedules.stage_program`) over `n` micro-batches, talking through
    `p2p`; `before_backward(last)` runs before each chunk backward (`last`: the chunk's last of the
    step), every chunk forward inside `compute_context()`. `check` asks, once, whether training_step
    returned the placeholder unchanged."""

    def __init__(
        self,
        program: list[Step],
        n: int,
        chunks: StageChunks,
        p2p: StageP2P,
        before_backward: Callable[[bool], None],
        compute_context: Callable[[], AbstractContextManager],
        check: bool,
    ) -> None:
        self.program, self.n, self.chunks, self.p2p = program, n, chunks, p2p
        self.before_backward, self.compute_context, self.check = before_backward, compute_context, check
        self.pos = 0  # the next step of the program
        self.max_in_flight = 0  # most chunk activations alive at once
        self.key: Hashable | None = None  # the step's input shape (micro-batch 0's): its activations'
        self._micro: dict[int, _Micro] = {}
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, Any]] = {}  # (input, output)
        self._outbox: dict[Message, torch.Tensor | None] = {}  # computed, for the next exchange
        self._inbox: dict[Message, Recv] = {}  # posted receives
        self._before_last = p2p.posted  # batches posted before the previous action
        actions = [step.action for step in program if isinstance(step, Run)]
        last = {(kind, c): k for k, (kind, _, c) in enumerate(actions)}
        self._last_backward = {actions[k] for (kind, _), k in last.items() if kind == BACKWARD}
        self._first_backward_chunk = len(chunks.virtual_stages) - 1

    # ---- the trainer's inputs -----------------------------------------------------------------
    def called(self, i: int) -> bool:
        return i in self._micro

    def call(self, i: int, input_ids: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """Micro-batch i's model call: run on; the real loss if it is known now, else a placeholder."""
        key = tuple(input_ids.shape)
        if self.key is None:
            self.key = key
        elif key != self.key:
            raise UsageError(
                f"under pipeline parallelism every micro-batch of an optimizer step must have the shape of "
                f"the first (the stages post their receives ahead): micro-batch {i}'s input is {key}, the "
                f"first's {self.key}; drop the last incomplete batch (drop_last=True) or pad it"
            )
        micro = _Micro((input_ids, args, kwargs), torch.is_grad_enabled())
        self._micro[i] = micro
        self.advance()
        if micro.loss is not None:  # the last virtual stage ran inside this call
            return micro.loss
        micro.placeholder = Placeholder.make(input_ids.device, micro.slot)
        return micro.placeholder

    def backward(self, i: int, loss: torch.Tensor) -> None:
        """The trainer back-propagates `loss` (micro-batch i's loss / n): run on."""
        self._micro[i].seed = loss
        self.advance()

    def advance(self) -> None:
        """Run the program until an action needs an input the trainer has not given yet."""
        while self.pos < len(self.program):
            step = self.program[self.pos]
            if isinstance(step, Exchange):
                if self.key is None:  # the shapes are known from micro-batch 0's model call on
                    return
                self._exchange(step)
            else:
                kind, i, c = step.action
                micro = self._micro.get(i)
                if micro is None:  # its first chunk forward waits for training_step(i)'s model call
                    return
                if kind == BACKWARD and c == self._first_backward_chunk and micro.seed is None:
                    return  # its first chunk backward waits for the trainer's backward(i)
                posted = self.p2p.posted
                self.p2p.complete_first(self._before_last)  # sends two actions old: let them go
                self._before_last = posted
                if kind == FORWARD:
                    self._chunk_forward(i, c)
                else:
                    self.before_backward(step.action in self._last_backward)
                    self._chunk_backward(i, c)
            self.pos += 1

    # ---- the program's steps -------------------------------------------------------------------
    def _exchange(self, step: Exchange) -> None:
        """Post the plan's batch: what was computed for it, and the receives of later actions."""
        sends = [(kind, (self.key, b), self._outbox.pop((kind, i, b))) for kind, i, b in step.sends]
        recvs = [Recv(kind, (self.key, b)) for kind, _, b in step.recvs]
        self._inbox.update(zip(step.recvs, recvs, strict=True))
        self.p2p.exchange(sends, recvs)

    def _chunk_forward(self, i: int, c: int) -> None:
        micro, g = self._micro[i], self.chunks.virtual_stages[c]
        input_ids, args, kwargs = micro.call
        if g > 0:  # (B, T, C): virtual stage g-1's output
            x = self.p2p.wait(self._inbox.pop((FORWARD, i, g)))
            x.requires_grad_(micro.grad_enabled)  # a leaf: its .grad is what we send back
            kwargs = {**kwargs, "hidden_states": x}
        else:
            x = None
        with torch.set_grad_enabled(micro.grad_enabled), self.compute_context():
            out = self.chunks.forward(c, input_ids, args, kwargs)
        self._saved[(i, c)] = (x, out)
        self.max_in_flight = max(self.max_in_flight, len(self._saved))
        if g < self.chunks.num_chunks - 1:
            self._outbox[(FORWARD, i, g + 1)] = out  # to the next virtual stage
            return
        micro.loss = out
        if micro.placeholder is not None:  # the user holds the placeholder: it takes the loss's value
            with torch.no_grad():
                micro.placeholder.copy_(_scalar(out))

    def _chunk_backward(self, i: int, c: int) -> None:
        micro, g = self._micro[i], self.chunks.virtual_stages[c]
        last = g == self.chunks.num_chunks - 1
        x, out = self._saved.pop((i, c))
        if c == self._first_backward_chunk:  # the trainer's loss: through the chunk, or the placeholder
            torch.autograd.backward(micro.seed)
            if last and micro.placeholder is not None:
                self._check_returned(i, micro)
                torch.autograd.backward(out, micro.slot.grad)  # the real loss, scaled as the trainer's
        if not last:  # d loss / d output from the next virtual stage
            torch.autograd.backward(out, self.p2p.wait(self._inbox.pop((BACKWARD, i, g + 1))))
        if g == 0:
            return
        grad, x.grad = x.grad, None
        # The received input is a leaf of a graph whose root -- the loss, kept for the step's
        # metrics by the trainer and `micro.loss` -- outlives this backward, and the root's nodes
        # reference their leaves: without this the last stage would hold every micro-batch's input
        # (and its gradient) until the step ends. Nothing reads x again.
        x.data = torch.empty(0, dtype=x.dtype, device=x.device)
        self._outbox[(BACKWARD, i, g)] = grad  # d loss / d input, to the previous virtual stage

    def _check_returned(self, i: int, micro: _Micro) -> None:
        """Once per run: the trainer back-propagates the placeholder unchanged (now the loss)."""
        if not self.check:
            return
        self.check = False
        if micro.slot.grad is None or not torch.allclose(
            micro.seed.detach().float() * self.n, micro.loss.detach().float(), rtol=1e-5, atol=1e-7
        ):
            raise RuntimeError(
                f"under interleaved pipeline parallelism training_step must return the loss self.model(...) "
                f"returned, unchanged (micro-batch {i}): its value is known only once the micro-batch reaches "
                "the last virtual stage, after training_step has returned; log it and return it as it is"
            )

    def finish(self) -> None:
        """End of the step: nothing may be left to run."""
        self.advance()
        if self.pos < len(self.program):
            left = [step.action for step in self.program[self.pos :] if isinstance(step, Run)]
            kind, i, c = left[0] if left else (FORWARD, 0, 0)
            raise RuntimeError(
                f"the pipeline step ended with chunk {c}'s {'forward' if kind == FORWARD else 'backward'} of "
                f"micro-batch {i} still to run: the trainer did not hand the stage every micro-batch"
            )


def _scalar(loss: torch.Tensor) -> torch.Tensor:
    if loss.numel() != 1:
        raise RuntimeError(
            f"under interleaved pipeline parallelism the model must compute the loss itself (it returned a "
            f"tensor of shape {tuple(loss.shape)}): call self.model(input_ids, labels=labels)"
        )
    return loss.detach().reshape(())
