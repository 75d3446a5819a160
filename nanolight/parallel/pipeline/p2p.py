"""Point-to-point exchange between neighbouring pipeline stages, in the batches of the plan.

A stage talks to the same tp (and dp, cp) coordinate of its two ring neighbours (with virtual
stages the last rank's chunk c feeds rank 0's chunk c+1, so the ring closes) on ONE process group:
activations go to the next rank, their gradients back to the previous one. What goes in which
batch, and in which order, is the plan's (`schedules.stage_program`): each `exchange` is one
``batch_isend_irecv`` (through `parallel/p2p.post`) that the neighbours post with the matching
sends and receives at the same point of their own plans, so NCCL, which runs a communicator's
operations one after the other in issue order and finishes a batch only when all of it has met
the peer, never waits on a cycle (`tests/_nccl_emulation.py` replays every test's traffic by those
rules). Receives of different actions may share a batch: they were all produced at the plan's same
time, and the neighbours' matching batches hold exactly their counterparts.

Shapes and dtypes are known at both ends before posting (NCCL checks nothing): an activation's
shape follows from the step's input shape (the `key`), so it is cached per key and boundary. The
first time a key crosses a boundary, its shape travels first in a batch of its own (a fixed-size
metadata tensor), posted by both ends at the same point; afterwards no metadata moves. A gradient
has its activation's shape and dtype.

A world whose messages carry nothing (the dry run's fake process group: `stage.fake_world`)
cannot learn a shape from the handshake: there `known_shapes(key)` answers for the previous rank.
The handshake is still posted, so the traffic is a real run's, and every activation this stage
sends is checked against `known_shapes`, so a wrong answer fails where the boundary's sender runs
rather than passing unnoticed.

Completion. `wait(recv)` completes every batch this stage posted up to the receive's, in order,
sends included: under NCCL the receive's batch finishes after the earlier ones anyway (one stream),
so the extra waits cost nothing there, and on gloo the stage then blocks exactly where NCCL would.
A sent tensor is held until its batch is complete, and before each action the stage completes
what it posted before the previous action (`complete_first`: two actions' worth of transfer time),
so what a stage holds for sends follows its plan deterministically, whatever the peer's timing
(`schedules.held_sends`); `finish` completes the rest at the end of a step.
`traffic` counts the bytes sent and the most held per stream (activations, gradients) in the
current step, `last_traffic` in the last finished one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from nanolight.parallel.p2p import Message, post
from nanolight.parallel.pipeline.schedules import FORWARD

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
META_LEN = 8  # [ndim, dtype code, *shape] padded: activations have at most 6 dims
Shape = tuple[torch.Size, torch.dtype]


@dataclass
class Recv:
    """One receive: an activation (`kind` FORWARD, from the previous rank) or a gradient (from the
    next) for `key`; `tensor` and `batch` are set once it is posted."""

    kind: str
    key: Hashable
    tensor: torch.Tensor | None = None
    batch: int = -1


@dataclass
class Traffic:
    """What went between this stage and its neighbours in one step (or forward-only pass): bytes
    sent, and the most bytes held for sends not yet complete, per stream (activations,
    gradients)."""

    sent_bytes: list[int] = field(default_factory=lambda: [0, 0])
    peak_held_bytes: list[int] = field(default_factory=lambda: [0, 0])


@dataclass
class _Batch:
    works: list[Any]  # they hold the batch's tensors
    held: list[int]  # bytes held for its sends, per stream


class StageP2P:
    """Exchanges activations and gradients with `prev_rank` / `next_rank` (global ranks) on
    `group` (None: the default group)."""

    def __init__(self, prev_rank: int, next_rank: int, device: torch.device, group: Any = None) -> None:
        self.prev_rank, self.next_rank, self.device, self.group = prev_rank, next_rank, device, group
        self._in_meta: dict[Hashable, tuple[torch.Size, torch.dtype]] = {}  # what prev sends us
        self._out_meta: dict[Hashable, tuple[torch.Size, torch.dtype]] = {}  # what we send next
        self._pending: deque[_Batch] = deque()  # posted and not yet complete, in order
        self._posted = 0  # batches posted so far (a batch's number: its position)
        self._held = [0, 0]
        self.traffic, self.last_traffic = Traffic(), Traffic()
        self.metadata_messages = 0  # handshakes sent + received: stays constant once warm
        self.recv_wait_s = 0.0  # time blocked in receives: this stage's share of the bubble
        self.send_wait_s = 0.0  # time blocked completing batches for their sends (`complete_first`, `finish`)
        self.known_shapes: Callable[[Hashable], Shape] | None = None  # a fake world's (`stage.fake_world`)

    def exchange(self, sends: list[tuple[str, Hashable, torch.Tensor | None]], recvs: list[Recv]) -> None:
        """Post one batch: `sends` ((kind, key, tensor): an activation to the next rank, or the
        gradient of the input `key` to the previous one; None: no gradient, zeros) and `recvs`."""
        out: list[tuple[int, int, torch.Tensor]] = []  # (stream, peer, tensor)
        shapes: list[Message] = []  # first-time activation shapes, to the next rank
        for kind, key, t in sends:
            if kind == FORWARD:
                t = t.detach().contiguous()
                if key not in self._out_meta:
                    self._out_meta[key] = (t.shape, t.dtype)
                    self._check_known(key, t)
                    shapes.append((self.next_rank, _encode(t.shape, t.dtype, self.device)))
                out.append((0, self.next_rank, t))
            else:
                shape, dtype = self._in_meta[key]
                t = torch.zeros(shape, dtype=dtype, device=self.device) if t is None else t
                out.append((1, self.prev_rank, t.detach().to(dtype).contiguous()))
        new = [r for r in recvs if r.kind == FORWARD and r.key not in self._in_meta]
        if shapes or new:
            self._handshake(shapes, new)
        for r in recvs:
            shape, dtype = (self._in_meta if r.kind == FORWARD else self._out_meta)[r.key]
            r.tensor = torch.empty(shape, dtype=dtype, device=self.device)
            r.batch = self._posted
        incoming = [(self.prev_rank if r.kind == FORWARD else self.next_rank, r.tensor) for r in recvs]
        # activations to the next rank, gradients to the previous one, and what they send us
        self._post([(peer, t) for _, peer, t in out], incoming, [(s, t) for s, _, t in out])

    def wait(self, recv: Recv) -> torch.Tensor:
        """The received tensor, once its batch (and every earlier one) is complete."""
        start = time.perf_counter()
        self._complete_through(recv.batch)
        self.recv_wait_s += time.perf_counter() - start
        return recv.tensor

    @property
    def posted(self) -> int:
        """How many batches this stage has posted so far (numbered from 0 in posting order)."""
        return self._posted

    def complete_first(self, count: int) -> None:
        """Complete the first `count` batches ever posted (those not complete yet, in order)."""
        start = time.perf_counter()
        self._complete_through(count - 1)
        self.send_wait_s += time.perf_counter() - start

    def finish(self) -> None:
        """Complete every batch posted so far (end of a step / forward-only pass); the step's
        `traffic` becomes `last_traffic`."""
        start = time.perf_counter()
        self._complete_through(self._posted - 1)
        self.send_wait_s += time.perf_counter() - start
        self.last_traffic, self.traffic = self.traffic, Traffic()

    # ---- internals --------------------------------------------------------------------------
    def _handshake(self, shapes: list[Message], new: list[Recv]) -> None:
        """Activation shapes crossing a boundary for the first time, in a batch of their own just
        ahead of the tensors' (the neighbour posts its counterpart at the same point)."""
        metas = [torch.empty(META_LEN, dtype=torch.int64, device=self.device) for _ in new]
        # shapes: ours to the next rank, the previous rank's to us
        self._post(shapes, [(self.prev_rank, m) for m in metas], [])
        self._complete_through(self._posted - 1)
        for r, meta in zip(new, metas, strict=True):
            self._in_meta[r.key] = _decode(meta) if self.known_shapes is None else self.known_shapes(r.key)
        self.metadata_messages += len(shapes) + len(new)

    def _check_known(self, key: Hashable, t: torch.Tensor) -> None:
        """What this stage sends for `key` is what `known_shapes` tells its next rank to expect."""
        if self.known_shapes is None:
            return
        expected, dtype = self.known_shapes(key)
        if (expected, dtype) != (t.shape, t.dtype):
            raise RuntimeError(
                f"pipeline boundary {key}: this stage sends {tuple(t.shape)} {t.dtype}, but known_shapes tells "
                f"the next stage to expect {tuple(expected)} {dtype}"
            )

    def _post(self, sends: list[Message], recvs: list[Message], held: list[tuple[int, torch.Tensor]]) -> None:
        send_works, recv_works = post(self.group, sends, recvs)  # one batch_isend_irecv
        # NCCL coalesces a batch into one work (`post` repeats it per op): wait for each once
        batch = _Batch(list({id(w): w for w in send_works + recv_works}.values()), [0, 0])
        for stream, t in held:
            nbytes = t.numel() * t.element_size()
            batch.held[stream] += nbytes
            self._held[stream] += nbytes
            self.traffic.sent_bytes[stream] += nbytes
            self.traffic.peak_held_bytes[stream] = max(
                self.traffic.peak_held_bytes[stream], self._held[stream]
            )
        self._pending.append(batch)
        self._posted += 1

    def _complete_through(self, index: int) -> None:
        """Wait for batches in the order posted, up to number `index`, and let go of them."""
        while self._posted - len(self._pending) <= index:
            batch = self._pending.popleft()
            for work in batch.works:
                work.wait()  # NCCL: the compute stream waits for the batch; gloo: the host does
            for stream in (0, 1):
                self._held[stream] -= batch.held[stream]


def _encode(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if len(shape) > META_LEN - 2:
        raise ValueError(f"pipeline activations may have at most {META_LEN - 2} dims, got {tuple(shape)}")
    values = [len(shape), DTYPES.index(dtype), *shape]
    return torch.tensor(values + [0] * (META_LEN - len(values)), dtype=torch.int64, device=device)


def _decode(meta: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    ndim, code, *rest = meta.tolist()
    return torch.Size(rest[:ndim]), DTYPES[code]
