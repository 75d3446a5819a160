"""Point-to-point exchange between neighbouring pipeline stages.

Four operations, each between this rank and the same tp (and dp) coordinate of a neighbour:

    send_forward   this stage -> next stage   the activation (stage output) of a micro-batch
    recv_forward   prev stage -> this stage   that activation, as this stage's input
    send_backward  this stage -> prev stage   d loss / d (this stage's input)
    recv_backward  next stage -> this stage   d loss / d (this stage's output)

Shapes and dtypes are known up front: a stage's activation shape depends only on the
micro-batch's `input_ids` shape (every stage sees the batch), so it is cached per input shape
(the `key`). The first time a key is seen, the sender sends a small metadata tensor ahead of
the activation; afterwards no metadata moves. A gradient always has the shape and dtype of the
activation it belongs to, so gradients never need metadata.

Sends are asynchronous (`isend`): with blocking sends, 1F1B deadlocks at the warm-up/steady
boundary, where stage s sends activation k while stage s+1 first sends gradient 0 back.
Receives block (the data is needed now). Pending sends are waited for at the end of the step.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
META_LEN = 8  # [ndim, dtype code, *shape] padded: activations have at most 6 dims


class StageP2P:
    """Sends/receives activations and gradients to `prev_rank` / `next_rank` (global ranks)."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device) -> None:
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, device
        self._in_meta: dict[Hashable, tuple[torch.Size, torch.dtype]] = {}  # what prev sends us
        self._out_meta: dict[Hashable, tuple[torch.Size, torch.dtype]] = {}  # what we send next
        self._pending: list[tuple[Any, torch.Tensor]] = []  # (work, tensor kept alive until done)
        self.metadata_messages = 0  # handshakes sent + received: stays constant once warm
        self.recv_wait_s = 0.0  # time blocked in receives: this stage's share of the bubble

    # ---- activations (forward) ------------------------------------------------------------
    def send_forward(self, x: torch.Tensor, key: Hashable) -> None:
        assert self.next_rank is not None
        x = x.detach().contiguous()
        if key not in self._out_meta:
            self._out_meta[key] = (x.shape, x.dtype)
            self._isend(_encode(x.shape, x.dtype, self.device), self.next_rank)  # metadata -> next stage
            self.metadata_messages += 1
        self._isend(x, self.next_rank)  # this stage's output -> next stage's input

    def recv_forward(self, key: Hashable) -> torch.Tensor:
        assert self.prev_rank is not None
        if key not in self._in_meta:
            meta = torch.empty(META_LEN, dtype=torch.int64, device=self.device)
            dist.recv(meta, src=self.prev_rank)  # metadata <- prev stage (first time only)
            self._in_meta[key] = _decode(meta)
            self.metadata_messages += 1
        shape, dtype = self._in_meta[key]
        x = torch.empty(shape, dtype=dtype, device=self.device)
        self._recv(x, self.prev_rank)  # prev stage's output -> our input
        return x

    # ---- gradients (backward) -------------------------------------------------------------
    def send_backward(self, grad: torch.Tensor | None, key: Hashable) -> None:
        assert self.prev_rank is not None
        shape, dtype = self._in_meta[key]
        grad = torch.zeros(shape, dtype=dtype, device=self.device) if grad is None else grad
        self._isend(grad.detach().to(dtype).contiguous(), self.prev_rank)  # d loss/d input -> prev

    def recv_backward(self, key: Hashable) -> torch.Tensor:
        assert self.next_rank is not None
        shape, dtype = self._out_meta[key]
        grad = torch.empty(shape, dtype=dtype, device=self.device)
        self._recv(grad, self.next_rank)  # d loss/d our output <- next stage
        return grad

    # ---- bookkeeping ------------------------------------------------------------------------
    def _recv(self, tensor: torch.Tensor, src: int) -> None:
        start = time.perf_counter()
        dist.recv(tensor, src=src)  # blocks until the neighbour's matching send arrives
        self.recv_wait_s += time.perf_counter() - start

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        self._pending.append((dist.isend(tensor, dst=dst), tensor))

    def wait(self) -> None:
        """Block until every send issued so far has completed (end of a step / forward-only pass)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def _encode(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if len(shape) > META_LEN - 2:
        raise ValueError(f"pipeline activations may have at most {META_LEN - 2} dims, got {tuple(shape)}")
    values = [len(shape), DTYPES.index(dtype), *shape]
    return torch.tensor(values + [0] * (META_LEN - len(values)), dtype=torch.int64, device=device)


def _decode(meta: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    ndim, code, *rest = meta.tolist()
    return torch.Size(rest[:ndim]), DTYPES[code]
