"""`StepRun`: one optimizer step of a pipeline stage -- its stage-level schedule, run as far as the
trainer's inputs allow.

The schedule (`schedules.stage_schedule`) is a list of chunk forwards and backwards. Two kinds of
action wait for the trainer: micro-batch i's first chunk forward needs the arguments of its
model call (`call`), its first chunk backward the loss the trainer back-propagates (`backward`).
After each input `advance` runs the list up to the next action still waiting (or to its end):

    chunk forward   receive the activation (not on virtual stage 0) -> the chunk -> send it on
                    (on the last virtual stage: the model's own loss, or logits)
    chunk backward  receive d loss / d output (not on the last virtual stage) -> autograd ->
                    send d loss / d input (not on virtual stage 0)

Communication overlaps compute (`p2p.py`): before computing action k the receive of action k+1
is posted, the send of action k goes out in one batch with the receive of action k+2, and a
receive is waited for only when its action runs. A receive can be posted only once its shape is
known -- its micro-batch's model call has happened (and, the very first time, the sender's
metadata has arrived) -- and each stream is a FIFO, so receives are posted strictly in the
list's order: posting stops at the first that cannot go up yet and resumes when it can.

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

from nanolight.parallel.pipeline.p2p import Recv, StageP2P
from nanolight.parallel.pipeline.schedules import BACKWARD, FORWARD, ChunkAction
from nanolight.parallel.pipeline.split import PipelineSplit, StageLayers

UNKNOWN = object()  # a receive whose micro-batch has not been called yet: its shape is unknown


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
    key: Hashable  # its input shape: the activations' shapes follow from it
    grad_enabled: bool
    placeholder: torch.Tensor | None = None  # what the call returned, when not the real loss
    slot: GradSlot = field(default_factory=GradSlot)
    loss: torch.Tensor | None = None  # the last virtual stage's output (last rank only)
    seed: torch.Tensor | None = None  # the trainer's loss_i / n, from `backward`


class StepRun:
    """Stage `chunks`'s step of `actions` over `n` micro-batches, talking through `p2p`;
    `before_backward(last)` runs before each chunk backward (`last`: the chunk's last of the
    step), every chunk forward inside `compute_context()`. `check` asks, once, whether training_step
    returned the placeholder unchanged."""

    def __init__(
        self,
        actions: list[ChunkAction],
        n: int,
        chunks: StageChunks,
        p2p: StageP2P,
        before_backward: Callable[[bool], None],
        compute_context: Callable[[], AbstractContextManager],
        check: bool,
    ) -> None:
        self.actions, self.n, self.chunks, self.p2p = actions, n, chunks, p2p
        self.before_backward, self.compute_context, self.check = before_backward, compute_context, check
        self.pos = 0  # the next action to run
        self.max_in_flight = 0  # most chunk activations alive at once
        self._micro: dict[int, _Micro] = {}
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, Any]] = {}  # (input, output)
        self._recvs: dict[int, Recv] = {}  # posted receives by action index
        self._posted = -1  # the receives of the actions up to here are posted (or they have none)
        last = {(kind, c): k for k, (kind, _, c) in enumerate(actions)}
        self._last_backward = {k for (kind, _), k in last.items() if kind == BACKWARD}
        self._first_backward_chunk = len(chunks.virtual_stages) - 1

    # ---- the trainer's inputs -----------------------------------------------------------------
    def called(self, i: int) -> bool:
        return i in self._micro

    def call(self, i: int, input_ids: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """Micro-batch i's model call: run on; the real loss if it is known now, else a placeholder."""
        micro = _Micro((input_ids, args, kwargs), tuple(input_ids.shape), torch.is_grad_enabled())
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
        """Run the list until an action needs an input the trainer has not given yet."""
        while self.pos < len(self.actions):
            kind, i, c = self.actions[self.pos]
            micro = self._micro.get(i)
            if micro is None:  # its first chunk forward waits for training_step(i)'s model call
                return
            if kind == BACKWARD and c == self._first_backward_chunk and micro.seed is None:
                return  # its first chunk backward waits for the trainer's backward(i)
            self._run(self.pos)
            self.pos += 1

    # ---- one action ----------------------------------------------------------------------------
    def _run(self, k: int) -> None:
        kind, i, c = self.actions[k]
        self.p2p.exchange([], self._next_recvs(k + 1))  # the next action's receive, before this compute
        recv = self._recvs.pop(k, None) or self._recv_of(k)
        self._posted = max(self._posted, k)
        received = self.p2p.wait(recv) if isinstance(recv, Recv) else None
        if kind == FORWARD:
            sends = self._chunk_forward(i, c, received)
        else:
            self.before_backward(k in self._last_backward)
            sends = self._chunk_backward(i, c, received)
        self.p2p.exchange(sends, self._next_recvs(k + 2))  # this send, with the receive after next

    def _recv_of(self, k: int) -> Recv | None | object:
        """Action k's receive: None if it has none, UNKNOWN if its micro-batch has no call yet."""
        kind, i, c = self.actions[k]
        micro, g = self._micro.get(i), self.chunks.virtual_stages[c]
        if (kind == FORWARD and g == 0) or (kind == BACKWARD and g == self.chunks.num_chunks - 1):
            return None
        if micro is None:
            return UNKNOWN
        if kind == FORWARD:
            return self.p2p.recv_forward((micro.key, g))  # our input: virtual stage g-1's output
        return self.p2p.recv_backward((micro.key, g + 1))  # d loss / d our output (g+1's input)

    def _next_recvs(self, upto: int) -> list[Recv]:
        """The receives after the last posted one, through action `upto`, that can go up now: in
        order, stopping at the first that cannot (each stream is a FIFO)."""
        out = []
        while self._posted < min(upto, len(self.actions) - 1):
            recv = self._recv_of(self._posted + 1)
            if recv is UNKNOWN or (isinstance(recv, Recv) and not self.p2p.postable(recv)):
                break
            if isinstance(recv, Recv):
                self._recvs[self._posted + 1] = recv
                out.append(recv)
            self._posted += 1
        return out

    def _chunk_forward(self, i: int, c: int, x: torch.Tensor | None) -> list:
        micro, g = self._micro[i], self.chunks.virtual_stages[c]
        input_ids, args, kwargs = micro.call
        if x is not None:
            x.requires_grad_(micro.grad_enabled)  # a leaf: its .grad is what we send back
            kwargs = {**kwargs, "hidden_states": x}
        with torch.set_grad_enabled(micro.grad_enabled), self.compute_context():
            out = self.chunks.forward(c, input_ids, args, kwargs)
        self._saved[(i, c)] = (x, out)
        self.max_in_flight = max(self.max_in_flight, len(self._saved))
        if g < self.chunks.num_chunks - 1:
            return self.p2p.send_forward(out, (micro.key, g + 1))  # (B, T, C) to the next virtual stage
        micro.loss = out
        if micro.placeholder is not None:  # the user holds the placeholder: it takes the loss's value
            with torch.no_grad():
                micro.placeholder.copy_(_scalar(out))
        return []

    def _chunk_backward(self, i: int, c: int, grad: torch.Tensor | None) -> list:
        micro, g = self._micro[i], self.chunks.virtual_stages[c]
        last = g == self.chunks.num_chunks - 1
        x, out = self._saved.pop((i, c))
        if c == self._first_backward_chunk:  # the trainer's loss: through the chunk, or the placeholder
            torch.autograd.backward(micro.seed)
            if last and micro.placeholder is not None:
                self._check_returned(i, micro)
                torch.autograd.backward(out, micro.slot.grad)  # the real loss, scaled as the trainer's
        if not last:
            torch.autograd.backward(out, grad)  # d loss / d output from the next virtual stage
        if g == 0:
            return []
        grad, x.grad = x.grad, None
        # The received input is a leaf of a graph whose root -- the loss, kept for the step's
        # metrics by the trainer and `micro.loss` -- outlives this backward, and the root's nodes
        # reference their leaves: without this the last stage would hold every micro-batch's input
        # (and its gradient) until the step ends. Nothing reads x again.
        x.data = torch.empty(0, dtype=x.dtype, device=x.device)
        return self.p2p.send_backward(grad, (micro.key, g))  # d loss / d input to the previous one

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
        if self.pos < len(self.actions):
            kind, i, c = self.actions[self.pos]
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
