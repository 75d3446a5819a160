"""Ring attention: causal attention over a sequence split across a context-parallel (cp) group.

Why: a sequence longer than one GPU's activations allow is split along time over `cp` ranks.
Queries stay where they are; the keys and values travel: every rank passes its K/V block to the
next rank of the ring and receives the previous rank's, `cp` blocks in all, posting the next
exchange before it computes on the current block. Each block gives a partial result and its
row-wise log-sum-exp; partials merge exactly by the log-sum-exp rule, so the output equals
attention over the whole sequence. The backward pass rotates K/V again; each block's key/value
gradients start at the first rank after its owner and travel on around the ring to it (cp - 1
hops, in K/V's dtype: the bytes of the K/V that came), each rank adding its share in fp32 and
posting the sum on, waiting for the previous rank's only after its own kernels ran. The owner
keeps its own share at home and adds the arriving sum last.

Causal load balance (zigzag): the sequence is cut into 2·cp chunks and rank r holds chunks r and
2·cp−1−r (`zigzag_shard`), so every rank has the same share of the causal triangle. Positions
(for RoPE and the mask) are global (`zigzag_positions`). Grouped-query attention rotates only
the kv heads, and the kernels map them to the query heads (no copy per head). Packed documents
stay apart across chunk boundaries: each rank's document ids are all-gathered once per forward
(`prepare`), and each query of a block sees one range of its keys (`_first_keys`).

Each block (chunk pair, c = T/(2·cp) tokens) runs the fused kernel the device has, returning the
softmax statistics (`parallel/ring_kernels.py`). Pairs wholly in the future are skipped, pairs
wholly in the past need no causal mask. Autocast is off
inside the ring: forward and backward compute in the dtype q, k, v arrive in. Every exchange
goes through `p2p.post` (NCCL's batched p2p rules).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from nanolight.models.attention import Documents
from nanolight.parallel.p2p import post
from nanolight.parallel.ring_kernels import Block, block_kernel


def zigzag_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices (of 2·cp) that cp rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def zigzag_shard(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's share of a whole-sequence tensor: chunks r and 2·cp−1−r along `dim`."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(
            f"context parallelism splits the sequence into 2*cp = {2 * cp} equal chunks, but its length "
            f"is {x.shape[dim]}; choose trainer.seq_len divisible by {2 * cp}"
        )
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = zigzag_chunks(rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def zigzag_unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole-sequence tensor from every cp rank's share (`parts[r]`: rank r's `zigzag_shard`)."""
    cp = len(parts)
    chunks: list[torch.Tensor] = [torch.empty(0)] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = zigzag_chunks(rank, cp)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def zigzag_positions(rank: int, cp: int, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """(seq_len / cp,) int64: the global positions of the tokens cp rank `rank` holds."""
    return zigzag_shard(torch.arange(seq_len, device=device), rank, cp, dim=0)


class RingDocuments(Documents):
    """A rank's packed-document ids plus every cp rank's (`ring_ids`, (cp, B, T/cp)), built once
    per forward by `RingAttention.prepare` and read by every layer."""

    def __init__(self, ids: torch.Tensor, ring_ids: torch.Tensor) -> None:
        super().__init__(ids)
        self.kernel = "ring"
        self.ring_ids = ring_ids


class RingAttention:
    """An attention backend (`models/attention.py` `AttentionBackend`) for a cp group: plug it in
    with `LlamaForCausalLM.set_attention_backend`. `ranks` are the group's global ranks in ring
    order; `group` the process group over them."""

    name = "ring"

    def __init__(self, group: Any, ranks: list[int]) -> None:
        self.group = group
        self.ranks = list(ranks)
        self.cp = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank())

    def prepare(self, documents: Documents) -> Documents:
        """The document ids of the whole ring, (cp, B, T/cp) in rank order: a block's mask needs
        the ids of the keys it holds, which come from another rank."""
        ids = documents.ids.contiguous()
        gathered = [torch.empty_like(ids) for _ in range(self.cp)]
        # every cp rank sends its (B, T/cp) document ids to every other one
        dist.all_gather(gathered, ids, group=self.group)
        return RingDocuments(ids, torch.stack(gathered))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        if documents is not None and not isinstance(documents, RingDocuments):
            raise TypeError("RingAttention.attend needs the documents its own prepare() returned")
        return _RingAttention.apply(q, k, v, None if documents is None else documents.ring_ids, self)

    def __repr__(self) -> str:
        return f"RingAttention(cp={self.cp}, rank={self.rank})"

    # --- the ring -------------------------------------------------------------------------------

    def rotate(self, send: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """Post `send` to the next rank and a receive of the same shape from the previous one;
        the receive buffer and the works to wait for before reading it (and reusing `send`)."""
        recv = torch.empty_like(send)
        nxt, prev = self.ranks[(self.rank + 1) % self.cp], self.ranks[(self.rank - 1) % self.cp]
        # each rank sends one block to the next rank of the ring and receives one from the previous
        sends, recvs = post(self.group, [(nxt, send)], [(prev, recv)])
        return recv, sends + recvs

    def around(self, kv: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(step, the K/V block held at that step) for the `cp` steps of the ring: the next
        block's exchange is posted before the current one is handed out (computation overlaps
        it) and waited for after."""
        for step in range(self.cp):
            nxt, works = self.rotate(kv) if step < self.cp - 1 else (None, [])
            yield step, kv
            for work in works:
                work.wait()
            kv = nxt if nxt is not None else kv

    def pairs(
        self, step: int, ring_ids: torch.Tensor | None, T: int
    ) -> list[tuple[slice, slice, bool, torch.Tensor | None]]:
        """At ring step `step` (holding the K/V of rank `rank - step`): the (query half, key half,
        causal, first visible key) blocks to compute. Key chunks wholly in a query chunk's future
        are left out, the diagonal one is causal, the rest see every key of their document."""
        src = (self.rank - step) % self.cp
        c = T // 2
        q_chunks, k_chunks = zigzag_chunks(self.rank, self.cp), zigzag_chunks(src, self.cp)
        blocks = []
        for qi, qc in enumerate(q_chunks):
            for ki, kc in enumerate(k_chunks):
                if kc > qc:
                    continue
                qs, ks = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
                first = None
                if ring_ids is not None:
                    first = _first_keys(ring_ids[self.rank][:, qs], ring_ids[src][:, ks], kc == qc)
                blocks.append((qs, ks, kc == qc, first))
        return blocks


def _first_keys(ids_q: torch.Tensor, ids_k: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """(B, c) int64: the first key of the block that each query sees (c: none), from the document
    ids of its queries and keys, (B, c) each. Documents are contiguous runs, so the keys a query
    sees are one range: on the diagonal from its document's start; in a past chunk the chunk's
    last run of keys, if that is the query's document (it then spans the chunks in between)."""
    if diagonal:
        return Documents(ids_q).starts()
    tail = Documents(ids_k).starts()[:, -1:]  # (B, 1): where the key chunk's last document starts
    return torch.where(ids_q == ids_k[:, -1:], tail, ids_k.shape[1])


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's partial result into the running one, in place (the log-sum-exp rule)."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), 0.0, new)
    out.mul_(torch.exp(lse - safe)[..., None]).add_(block_out * torch.exp(block_lse - safe)[..., None])
    lse.copy_(new)


class _RingAttention(torch.autograd.Function):
    """Forward and backward run with autocast off: the kernels compute in q, k, v's own dtype
    (what the projections produced) both ways, with fp32 statistics -- under autocast a forward
    matmul would run in bf16 while its backward, outside autocast, ran in fp32."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ring_ids: torch.Tensor | None,
        ring: RingAttention,
    ) -> torch.Tensor:
        B, H, T, D = q.shape
        if T % 2:
            raise ValueError(f"ring attention holds two equal chunks per rank; got {T} local tokens")
        scale = 1.0 / math.sqrt(D)
        out = torch.zeros(B, H, T, D, dtype=torch.float32, device=q.device)
        lse = torch.full((B, H, T), float("-inf"), dtype=torch.float32, device=q.device)
        kernels = []  # one per block, in order: the backward meets the blocks in the same order
        with torch.autocast(q.device.type, enabled=False):
            for step, kv in ring.around(torch.stack([k, v]).contiguous()):
                for qs, _, block in _blocks(ring, step, kv, q, ring_ids, scale):
                    kernel = block_kernel(q, block.first is not None)
                    block_out, block_lse = kernel.forward(block)
                    _merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
                    kernels.append(kernel)
        ctx.ring, ctx.ring_ids, ctx.scale, ctx.kernels = ring, ring_ids, scale, kernels
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, kernels = ctx.ring, iter(ctx.kernels)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # The gradients of the K/V block a rank holds travel with it, from the first rank after its
        # owner, home to it. Each step computes its own share first, then waits for the sum the
        # previous rank sent (posted a step earlier), adds it in fp32 and posts the sum on in K/V's
        # dtype: the rotation overlaps a step's compute. Step 0's share (this rank's own block)
        # stays here and takes the sum that comes home after the last step.
        own: torch.Tensor | None = None
        arriving: tuple[torch.Tensor, list[Any]] | None = None  # the sum on its way here, its works
        sent: torch.Tensor | None = None  # kept until its send is waited for (with the receive)
        with torch.autocast(q.device.type, enabled=False):
            for step, kv in ring.around(torch.stack([k, v]).contiguous()):
                dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
                for qs, ks, block in _blocks(ring, step, kv, q, ctx.ring_ids, ctx.scale):
                    block_dq, block_dk, block_dv = next(kernels).backward(
                        block, grad_out[:, :, qs], out[:, :, qs], lse[:, :, qs]
                    )
                    dq[:, :, qs] += block_dq
                    dkv[0][:, :, ks] += block_dk
                    dkv[1][:, :, ks] += block_dv
                if step == 0:
                    own = dkv
                    continue
                if arriving is not None:
                    dkv += _arrived(arriving)
                    arriving = sent = None
                # the block's sum so far goes to the next rank; after the last step this send
                # brings each block's gradients home to its owner (`rotate`: one send, one receive)
                sent = dkv.to(k.dtype)
                arriving = ring.rotate(sent)
        assert own is not None
        if arriving is not None:
            own += _arrived(arriving)
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None


def _arrived(arriving: tuple[torch.Tensor, list[Any]]) -> torch.Tensor:
    """The received buffer of a posted rotation, once its send and receive completed."""
    received, works = arriving
    for work in works:
        work.wait()
    return received


def _blocks(
    ring: RingAttention,
    step: int,
    kv: torch.Tensor,
    q: torch.Tensor,
    ring_ids: torch.Tensor | None,
    scale: float,
) -> Iterator[tuple[slice, slice, Block]]:
    """The blocks of ring step `step`, whose K/V (2, B, kv_heads, T, D) this rank holds now."""
    for qs, ks, causal, first in ring.pairs(step, ring_ids, q.shape[2]):
        k, v = (kv[i][:, :, ks].contiguous() for i in (0, 1))
        yield qs, ks, Block(q[:, :, qs].contiguous(), k, v, causal, first, scale)
