"""Point-to-point messages between ranks, issued the one way NCCL matches.

Every send and receive in nanolight goes through `post` (the pipeline's exchanges, a context-
parallel ring's K/V blocks). The rules it keeps are NCCL's, which gloo forgives:

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
- Order: NCCL runs a communicator's operations one after the other, in the order the rank
  issued them, and a batch finishes only when all of it has met the peer. Callers post batches
  that their peers post at the same point of the same plan (the pipeline: `pipeline/p2p.py`;
  ring attention: one send to the next rank and one receive from the previous per step).
"""

from __future__ import annotations

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
