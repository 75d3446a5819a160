"""Point-to-point messages between ranks, issued the one way NCCL matches, and their send buffers.

Every send and receive in nanolight goes through `post` (the pipeline's streams today, a context-
parallel ring's K/V blocks tomorrow). The rules it keeps are NCCL's, which gloo forgives:

- A send and its receive are issued the same way on the same group. NCCL runs a batched op
  (``batch_isend_irecv``) on the group's communicator but a plain ``send``/``recv`` on a separate
  two-rank one (``ProcessGroupNCCL``, ``isP2POp(opType, batchP2P)``), so a batched send and a plain
  receive never meet. `post` is always batched, so both ends always are.
- Both ends know the shape and dtype before posting: NCCL moves bytes and checks nothing. A
  message whose shape only the sender knows is preceded by a fixed-size metadata message
  (`pipeline/p2p.py`).
- The first batched call on a group, when it is the group's first operation, must be joined by
  every rank of the group (torch's note on ``batch_isend_irecv``): `ParallelContext` runs one
  all-reduce on each point-to-point group right after creating it.

`SendsInFlight` keeps each sent tensor alive until its send has completed and then drops it, so
memory held for sends follows what is actually in transit, not everything sent since the step
began. NCCL's ``Work.is_completed()`` polls the send's CUDA event; gloo marks a send completed
only once ``wait()`` is called on it, and ``wait()`` blocks until the peer posts its receive, so
under gloo a daemon thread per `SendsInFlight` waits for its sends in order (a FIFO: the peer
receives them in that order) and the owner drops what it has seen finish.
"""

from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

Message = tuple[int, torch.Tensor]  # (peer's global rank, tensor): sent, or filled by the receive


def post(group: Any, sends: list[Message], recvs: list[Message]) -> tuple[list[Any], list[Any]]:
    """Issue `sends` and post `recvs` on `group` (None: the world) as one batched call; the works
    of the sends and of the receives, in order. Every tensor is contiguous, and each receive's
    already has the shape and dtype its sender sends."""
    ops = [dist.P2POp(dist.isend, t, peer, group) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for peer, t in recvs]
    if not ops:
        return [], []
    # this rank's sends to / receives from its peers on `group`, as one batch
    works = dist.batch_isend_irecv(ops)
    if len(works) != len(ops):  # a coalescing backend (NCCL): the batch completes as one
        works = works * len(ops)
    return works[: len(sends)], works[len(sends) :]


@dataclass
class _Send:
    work: Any
    tensor: torch.Tensor | None
    nbytes: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class SendsInFlight:
    """The sends issued to one peer on one group (a FIFO), each tensor held until its send is done.

    `held_bytes` is what the held tensors take now, `peak_bytes` its high-water mark since the
    last `reset_peak`."""

    def __init__(self, group: Any) -> None:
        self._waited_on_thread = dist.get_backend(group) == "gloo"
        self._sends: list[_Send] = []
        self._queue: queue.SimpleQueue[_Send | None] | None = None
        self.held_bytes = self.peak_bytes = 0

    def add(self, works: list[Any], tensors: list[torch.Tensor]) -> None:
        """Hold `tensors` until their sends (`works`) complete."""
        for work, t in zip(works, tensors, strict=True):
            send = _Send(work, t, t.numel() * t.element_size())
            self._sends.append(send)
            self.held_bytes += send.nbytes
            if self._waited_on_thread:
                self._waiter().put(send)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def release_completed(self) -> None:
        """Drop every send that has completed (raising the error of one that failed)."""
        keep = []
        for send in self._sends:
            if self._finished(send):
                self._drop(send)
            else:
                keep.append(send)
        self._sends = keep

    def wait_all(self) -> None:
        """Block until every send has completed (each one's peer has posted its receive)."""
        for send in self._sends:
            if self._waited_on_thread:
                send.done.wait()
            else:
                send.work.wait()
            self._drop(send)
        self._sends = []

    def reset_peak(self) -> None:
        self.peak_bytes = self.held_bytes

    def _finished(self, send: _Send) -> bool:
        return send.done.is_set() if self._waited_on_thread else send.work.is_completed()

    def _drop(self, send: _Send) -> None:
        self.held_bytes -= send.nbytes
        send.tensor = send.work = None  # the work holds the tensor too
        if send.error is not None:
            raise send.error

    def _waiter(self) -> queue.SimpleQueue[_Send | None]:
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            waiter = threading.Thread(
                target=_wait_in_order, args=(self._queue,), name="nanolight-p2p-sends", daemon=True
            )
            waiter.start()
            weakref.finalize(self, self._queue.put, None)  # the thread ends with its owner
        return self._queue


def _wait_in_order(sends: queue.SimpleQueue[_Send | None]) -> None:
    """gloo only: wait for each send as it is queued, in order, and mark it done (or failed);
    None (its owner was freed) ends the thread."""
    while (send := sends.get()) is not None:
        try:
            send.work.wait()  # returns once the peer's receive has taken the tensor
        except BaseException as exc:  # noqa: BLE001 - handed to the owner, raised where it waits
            send.error = exc
        send.done.set()
        del send  # hold nothing while waiting for the next
