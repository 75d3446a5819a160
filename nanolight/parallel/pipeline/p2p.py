"""Point-to-point exchange between neighbouring pipeline stages, overlapped with compute.

Two streams, each between this rank and the same tp (and dp) coordinate of a ring neighbour
(with virtual stages the last rank's chunk c feeds rank 0's chunk c+1, so the ring closes):

    forward stream    virtual stage g -> g+1   the activation (g's output, g+1's input)
    backward stream   virtual stage g+1 -> g   d loss / d (that activation)

Each stream has its own process group (`ParallelContext.pp_p2p_groups`), so each stream and
direction is one FIFO on gloo and NCCL alike (NCCL ignores tags, which therefore could not keep
two streams apart): the k-th tensor a rank sends on it is the k-th its neighbour receives. The
schedules list both ends in the same order (`tests/test_pp_schedules.py` checks it).

Shapes and dtypes are known up front, at both ends (NCCL checks nothing: `parallel/p2p.py`): an
activation's shape depends only on the micro-batch's `input_ids` shape (every stage sees the
batch), so it is cached per input shape and stage boundary (the `key`). The first time a key is
seen, the sender sends a fixed-size metadata tensor ahead of the activation, and the receiver
receives it the same way (batched, on the same stream); afterwards no metadata moves. A gradient
always has the shape and dtype of the activation it belongs to, so gradients never need metadata.

Overlap. A receive is a `Recv`: the stage posts it (``irecv``) as soon as it knows the shape --
before computing the action ahead of the one that needs it -- and waits for it only when the
tensor is needed, so the transfer runs during that compute (gloo moves a tensor only once the
receive is posted). Sends are asynchronous; `exchange` issues a send together with the receives
posted after it, batched (``batch_isend_irecv``, through `parallel/p2p.post`) per stream. The
stage never waits for a send inside a step (that could block until the peer posts its receive):
no stage waits for anything but a tensor it needs, and the schedules' dependency order, which has
no cycle, is the only order of waits. A sent tensor is dropped as soon as its send completes
(`SendsInFlight`), so a stage holds only what is in transit, within its schedule's in-flight
bound; `finish` waits for the rest at the end of the step. `traffic` counts the bytes sent and
the most held per stream in the current step, `last_traffic` in the last finished one.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from nanolight.parallel.p2p import Message, SendsInFlight, post

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
META_LEN = 8  # [ndim, dtype code, *shape] padded: activations have at most 6 dims
FORWARD_STREAM, BACKWARD_STREAM = 0, 1


@dataclass
class Recv:
    """One receive: from `src` on `stream`, for `key`; `work` is set once it is posted."""

    stream: int
    src: int
    key: Hashable
    tensor: torch.Tensor | None = None
    work: Any = None


@dataclass
class Traffic:
    """What went between this stage and its neighbours in one step (or forward-only pass): bytes
    sent, and the most bytes held for sends not known to be complete, per stream (forward,
    backward). A stage's activations and gradients have one size, so the second over that size
    is how many of them this stage held at once for sends."""

    sent_bytes: list[int] = field(default_factory=lambda: [0, 0])
    peak_held_bytes: list[int] = field(default_factory=lambda: [0, 0])


class StageP2P:
    """Sends/receives activations and gradients to `prev_rank` / `next_rank` (global ranks) over
    `groups` = (forward stream group, backward stream group); None: the default group."""

    def __init__(
        self,
        prev_rank: int | None,
        next_rank: int | None,
        device: torch.device,
        groups: tuple[Any, Any] = (None, None),
    ) -> None:
        self.prev_rank, self.next_rank, self.device, self.groups = prev_rank, next_rank, device, groups
        self._in_meta: dict[Hashable, tuple[torch.Size, torch.dtype]] = {}  # what prev sends us
        self._out_meta: dict[Hashable, tuple[torch.Size, torch.dtype]] = {}  # what we send next
        self._sends = tuple(SendsInFlight(g) for g in groups)  # per stream: sent tensors until done
        self.traffic, self.last_traffic = Traffic(), Traffic()
        self.metadata_messages = 0  # handshakes sent + received: stays constant once warm
        self.recv_wait_s = 0.0  # time blocked in receives: this stage's share of the bubble
        self.send_wait_s = 0.0  # time blocked at the end of a step until the last sends are received

    # ---- receives ---------------------------------------------------------------------------
    def recv_forward(self, key: Hashable) -> Recv:
        """The activation `key` from the previous stage (not posted yet: see `exchange`)."""
        assert self.prev_rank is not None
        return Recv(FORWARD_STREAM, self.prev_rank, key)

    def recv_backward(self, key: Hashable) -> Recv:
        """d loss / d (our activation `key`) from the next stage (not posted yet)."""
        assert self.next_rank is not None
        return Recv(BACKWARD_STREAM, self.next_rank, key)

    def postable(self, recv: Recv) -> bool:
        """The receive's shape is known, so it can be posted without a handshake."""
        meta = self._in_meta if recv.stream == FORWARD_STREAM else self._out_meta
        return recv.work is not None or recv.key in meta

    def wait(self, recv: Recv) -> torch.Tensor:
        """The received tensor: posts the receive first if it is not (learning an activation's
        shape from the sender's metadata the first time), then blocks until it has arrived."""
        start = time.perf_counter()
        if recv.work is None:
            if not self.postable(recv):  # first activation of this key: the sender sent metadata first
                meta = torch.empty(META_LEN, dtype=torch.int64, device=self.device)
                # metadata <- previous stage, on the forward stream just ahead of its activation,
                # batched as it was sent
                _, (work,) = post(self.groups[FORWARD_STREAM], [], [(recv.src, meta)])
                work.wait()
                self._in_meta[recv.key] = _decode(meta)
                self.metadata_messages += 1
            self.exchange([], [recv])
        recv.work.wait()  # blocks until the neighbour's matching send has arrived
        self.recv_wait_s += time.perf_counter() - start
        return recv.tensor

    # ---- sends --------------------------------------------------------------------------------
    def send_forward(self, x: torch.Tensor, key: Hashable) -> list[tuple[int, int, torch.Tensor]]:
        """The sends of activation `key` to the next stage (with its metadata the first time),
        for `exchange`."""
        assert self.next_rank is not None
        x = x.detach().contiguous()
        sends = []
        if key not in self._out_meta:
            self._out_meta[key] = (x.shape, x.dtype)
            sends.append((FORWARD_STREAM, self.next_rank, _encode(x.shape, x.dtype, self.device)))
            self.metadata_messages += 1
        return sends + [(FORWARD_STREAM, self.next_rank, x)]

    def send_backward(self, grad: torch.Tensor | None, key: Hashable) -> list[tuple[int, int, torch.Tensor]]:
        """The send of d loss / d (the input `key` we received) to the previous stage."""
        assert self.prev_rank is not None
        shape, dtype = self._in_meta[key]
        grad = torch.zeros(shape, dtype=dtype, device=self.device) if grad is None else grad
        return [(BACKWARD_STREAM, self.prev_rank, grad.detach().to(dtype).contiguous())]

    def exchange(self, sends: list[tuple[int, int, torch.Tensor]], recvs: list[Recv]) -> None:
        """Issue `sends` and post `recvs` (each must be `postable`), one batch per stream; drop
        the sent tensors whose sends have completed."""
        for held in self._sends:  # before sending more: what is held is only what is in transit
            held.release_completed()
        for stream in (FORWARD_STREAM, BACKWARD_STREAM):
            out: list[Message] = [(dst, t) for s, dst, t in sends if s == stream]
            mine = [r for r in recvs if r.stream == stream]
            for r in mine:
                shape, dtype = (self._in_meta if stream == FORWARD_STREAM else self._out_meta)[r.key]
                r.tensor = torch.empty(shape, dtype=dtype, device=self.device)
            # this stage's sends to / receives from its ring neighbours on this stream, as one batch
            send_works, recv_works = post(self.groups[stream], out, [(r.src, r.tensor) for r in mine])
            for r, w in zip(mine, recv_works, strict=True):
                r.work = w
            held = self._sends[stream]
            held.add(send_works, [t for _, t in out])
            self.traffic.sent_bytes[stream] += sum(t.numel() * t.element_size() for _, t in out)
            self.traffic.peak_held_bytes[stream] = max(self.traffic.peak_held_bytes[stream], held.peak_bytes)

    def finish(self) -> None:
        """Block until every send issued so far has completed (end of a step / forward-only pass);
        the step's `traffic` becomes `last_traffic`."""
        start = time.perf_counter()
        for held in self._sends:
            held.wait_all()
            held.reset_peak()
        self.send_wait_s += time.perf_counter() - start
        self.last_traffic, self.traffic = self.traffic, Traffic()


def _encode(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if len(shape) > META_LEN - 2:
        raise ValueError(f"pipeline activations may have at most {META_LEN - 2} dims, got {tuple(shape)}")
    values = [len(shape), DTYPES.index(dtype), *shape]
    return torch.tensor(values + [0] * (META_LEN - len(values)), dtype=torch.int64, device=device)


def _decode(meta: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    ndim, code, *rest = meta.tolist()
    return torch.Size(rest[:ndim]), DTYPES[code]
