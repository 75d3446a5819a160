"""`StepRun`: one optimizer step of a pipeline stage -- its program, run top to bottom.

The program (`schedules.stage_program`) is the stage's chunk forwards and backwards with the
plan's exchanges between them. `steps()` runs it in order and stops at the two kinds of action
that are the trainer's part, yielding them:

    exchange        post one batch: the outputs computed for it, the receives of later actions
    chunk forward   wait for the activation (not on virtual stage 0) -> the chunk -> its output
                    kept for the next exchange (on the last virtual stage: the loss, or logits)
                    -- a rank's FIRST chunk of micro-batch i yields (FORWARD, i): the trainer runs
                    training_step(i), whose model call (`call`) runs the chunk
    chunk backward  wait for d loss / d output (not on the last virtual stage) -> autograd ->
                    d loss / d input kept for the next exchange (not on virtual stage 0)
                    -- a rank's first chunk BACKWARD of micro-batch i yields (BACKWARD, i): the
                    trainer back-propagates loss_i / n, which runs the chunk (`backward`)

So the trainer calls training_step and the backward hooks once per micro-batch, in the order the
schedule reaches them, and everything else the stage does on its own. A receive is posted when
its sender computes it (the plan's time) and waited for when its action runs, so transfers
overlap compute. Its shape must be known when it is posted: the step's activations take the shape
of micro-batch 0's input (the exchanges before its model call are posted inside that call), and
a later micro-batch of another shape is an error.

The loss. The model call returns the real loss when the last virtual stage ran inside it (always
with one chunk per rank); otherwise a *placeholder* -- a zero scalar whose backward leaves
d(trainer's loss)/d(loss) (= 1/n) in a slot -- and the stage back-propagates the real loss with
that gradient. The placeholder is the price of training_step staying the user's: only the call
gives a chunk its arguments, so the call must come at the rank's first chunk, and a rank without
the last virtual stage has no loss to return. There it stays zero (the true loss reaches the
metrics through `Strategy.reduce`, from the last stage). On the last rank under interleaving the
micro-batch reaches the last chunk only after later micro-batches' calls, so the placeholder takes
the loss's value in place when it does: before the trainer divides it by n, back-propagates it,
reduces the step loss or reduces what `self.log` kept of it.
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
from nanolight.parallel.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    Action,
    ChunkAction,
    Exchange,
    Message,
    Run,
    Step,
)
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
        self.due: ChunkAction | None = None  # yielded to the trainer, run by its `call` / `backward`
        self.running = False  # between the first step and the end of `steps()`
        self.max_in_flight = 0  # most chunk activations alive at once
        self.key: Hashable | None = None  # the step's input shape (micro-batch 0's): its activations'
        self._micro: dict[int, _Micro] = {}
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, Any]] = {}  # (input, output)
        self._outbox: dict[Message, torch.Tensor | None] = {}  # computed, for the next exchange
        self._inbox: dict[Message, Recv] = {}  # posted receives
        self._unposted: list[Exchange] = []  # before micro-batch 0's call: the shapes are not known
        actions = [step.action for step in program if isinstance(step, Run)]
        last = {(kind, c): k for k, (kind, _, c) in enumerate(actions)}
        self._last_backward = {actions[k] for (kind, _), k in last.items() if kind == BACKWARD}
        self._first_backward_chunk = len(chunks.virtual_stages) - 1

    def steps(self) -> Iterator[Action]:
        """Run the program; yield (FORWARD | BACKWARD, i) where the trainer's part is due."""
        self.running, before_last = True, self.p2p.posted
        try:
            for step in self.program:
                if isinstance(step, Exchange):
                    self._unposted.append(step)
                    if self.key is not None:
                        self._post_unposted()
                    continue
                kind, i, c = step.action
                posted = self.p2p.posted
                self.p2p.complete_first(before_last)  # sends two actions old: let them go
                before_last = posted
                if kind == BACKWARD:
                    self.before_backward(step.action in self._last_backward)
                if (kind, c) in ((FORWARD, 0), (BACKWARD, self._first_backward_chunk)):
                    self.due = step.action  # micro-batch i's first chunk here: the trainer's turn
                    yield kind, i
                    self._check_done(kind, i)
                elif kind == FORWARD:
                    self._chunk_forward(i, c)
                else:
                    self._chunk_backward(i, c)
        finally:
            self.running = False

    # ---- the trainer's part -------------------------------------------------------------------
    def call(self, input_ids: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """The due micro-batch's model call: the real loss if the last virtual stage ran inside it,
        else a placeholder."""
        micro = self.start(input_ids, args, kwargs)
        if micro.loss is not None:
            return micro.loss
        micro.placeholder = Placeholder.make(input_ids.device, micro.slot)
        return micro.placeholder

    def start(self, input_ids: torch.Tensor, args: tuple, kwargs: dict) -> _Micro:
        """The due micro-batch's model-call arguments: its first chunk forward runs."""
        if self.due is None or self.due[0] != FORWARD:
            raise RuntimeError(
                "the pipelined model was called where the schedule has no forward due: under pipeline "
                "parallelism training_step must call self.model(...) exactly once per micro-batch"
            )
        _, i, c = self.due
        key = tuple(input_ids.shape)
        if self.key is None:
            self.key = key
            self._post_unposted()
        elif key != self.key:
            raise UsageError(
                f"under pipeline parallelism every micro-batch of an optimizer step must have the shape of "
                f"the first (the stages post their receives ahead): micro-batch {i}'s input is {key}, the "
                f"first's {self.key}; drop the last incomplete batch (drop_last=True) or pad it"
            )
        micro = _Micro((input_ids, args, kwargs), torch.is_grad_enabled())
        self._micro[i], self.due = micro, None
        self._chunk_forward(i, c)
        return micro

    def backward(self, loss: torch.Tensor) -> None:
        """The trainer back-propagates `loss` (the due micro-batch's loss / n): its first chunk backward."""
        if self.due is None or self.due[0] != BACKWARD:
            raise RuntimeError(
                "a backward under pipeline parallelism outside the schedule's backward of a micro-batch"
            )
        _, i, c = self.due
        self._micro[i].seed, self.due = loss, None
        self._chunk_backward(i, c)

    def _check_done(self, kind: str, i: int) -> None:
        if self.due is None:
            return
        if kind == FORWARD:
            raise RuntimeError(
                f"micro-batch {i} never went through the pipelined model; under pipeline parallelism "
                "training_step must call self.model(input_ids, labels=...) once"
            )
        raise RuntimeError(f"micro-batch {i}'s loss was not back-propagated by the trainer")

    # ---- the program's steps -------------------------------------------------------------------
    def _post_unposted(self) -> None:
        """Post the plan's batches not yet posted, in order: for each, what was computed for it and
        the receives of later actions."""
        for step in self._unposted:
            self._exchange(step)
        self._unposted.clear()

    def _exchange(self, step: Exchange) -> None:
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


def _scalar(loss: torch.Tensor) -> torch.Tensor:
    if loss.numel() != 1:
        raise RuntimeError(
            f"under interleaved pipeline parallelism the model must compute the loss itself (it returned a "
            f"tensor of shape {tuple(loss.shape)}): call self.model(input_ids, labels=labels)"
        )
    return loss.detach().reshape(())
