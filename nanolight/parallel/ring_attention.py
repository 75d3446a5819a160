"""Ring attention: causal attention over a sequence split across a context-parallel (cp) group.

Why: a sequence longer than one GPU's activations allow is split along time over `cp` ranks.
Queries stay where they are; the keys and values travel: every rank passes its K/V block to the
next rank of the ring and receives the previous rank's, `cp` blocks in all, posting the next
exchange before it computes on the current block. Each block gives a partial result and its
row-wise log-sum-exp; partials merge exactly by the log-sum-exp rule, so the output equals
attention over the whole sequence. The backward pass rotates K/V again and sends each block's
key/value gradients around with it, so they arrive back at the block's owner.

Causal load balance (zigzag): the sequence is cut into 2·cp chunks and rank r holds chunks r and
2·cp−1−r (`zigzag_shard`), so every rank has the same share of the causal triangle. Positions
(for RoPE and the mask) are global (`zigzag_positions`). Grouped-query attention rotates only
the kv heads. Packed documents stay apart across chunk boundaries: each rank's document ids are
all-gathered once per forward (`prepare`), and a block's mask compares them.

The block kernel is exact attention in fp32 with the softmax statistics kept (one (c × c) score
tile per chunk pair, c = T/(2·cp)); pairs wholly in the future are skipped, pairs wholly in the
past need no causal mask. Every exchange goes through `p2p.post` (NCCL's batched p2p rules).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from nanolight.models.attention import Documents
from nanolight.parallel.p2p import post


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

    def pairs(
        self, step: int, ring_ids: torch.Tensor | None, T: int, device: torch.device
    ) -> list[tuple[int, int, torch.Tensor | None]]:
        """At ring step `step` (holding the K/V of rank `rank - step`): the (query half, key half,
        mask) pairs to compute, the mask None where every key is visible to every query."""
        src = (self.rank - step) % self.cp
        c = T // 2
        q_chunks, k_chunks = zigzag_chunks(self.rank, self.cp), zigzag_chunks(src, self.cp)
        out = []
        for qi, qc in enumerate(q_chunks):
            for ki, kc in enumerate(k_chunks):
                if kc > qc:
                    continue  # wholly in the future
                mask = None
                if kc == qc:
                    mask = torch.ones(c, c, dtype=torch.bool, device=device).tril()[None]
                if ring_ids is not None:
                    same = (
                        ring_ids[self.rank][:, qi * c : (qi + 1) * c, None]
                        == ring_ids[src][:, None, ki * c : (ki + 1) * c]
                    )
                    mask = same if mask is None else same & mask
                out.append((qi, ki, None if mask is None else mask[:, None]))  # (B or 1, 1, c, c)
        return out


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (B, H, c, D) output and (B, H, c) log-sum-exp of one block; -inf rows see no key."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.matmul(p, v), lse


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's partial result into the running one, in place (the log-sum-exp rule)."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), 0.0, new)
    out.mul_(torch.exp(lse - safe)[..., None]).add_(block_out * torch.exp(block_lse - safe)[..., None])
    lse.copy_(new)


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, kv_heads, c, D) -> (B, heads, c, D): query head h reads kv head h // groups."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of `_expand` for gradients: sum the query heads that share a kv head."""
    if groups == 1:
        return grad
    B, H, c, D = grad.shape
    return grad.view(B, H // groups, groups, c, D).sum(2)


class _RingAttention(torch.autograd.Function):
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
        groups, c, scale = H // k.shape[1], T // 2, 1.0 / math.sqrt(D)
        qf = q.float()
        out = torch.zeros(B, H, T, D, dtype=torch.float32, device=q.device)
        lse = torch.full((B, H, T), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(ring.cp):
            nxt, works = ring.rotate(kv) if step < ring.cp - 1 else (None, [])
            kf, vf = _expand(kv[0].float(), groups), _expand(kv[1].float(), groups)
            for qi, ki, mask in ring.pairs(step, ring_ids, T, q.device):
                qs, ks = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
                block_out, block_lse = _block_forward(qf[:, :, qs], kf[:, :, ks], vf[:, :, ks], mask, scale)
                _merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            for work in works:
                work.wait()
            kv = nxt if nxt is not None else kv
        ctx.ring, ctx.ring_ids, ctx.scale, ctx.groups = ring, ring_ids, scale, groups
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, groups = ctx.ring, ctx.scale, ctx.groups
        T, c = q.shape[2], q.shape[2] // 2
        qf, do = q.float(), grad_out.float()
        delta = (do * out).sum(-1)  # (B, H, T): rowsum(dO ∘ O), the softmax backward's correction
        safe_lse = torch.where(torch.isinf(lse), 0.0, lse)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).contiguous()
        # the gradients of the K/V block a rank holds, travelling with it (fp32: summed over cp ranks)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for step in range(ring.cp):
            nxt, works = ring.rotate(kv) if step < ring.cp - 1 else (None, [])
            kf, vf = _expand(kv[0].float(), groups), _expand(kv[1].float(), groups)
            dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
            for qi, ki, mask in ring.pairs(step, ctx.ring_ids, T, q.device):
                qs, ks = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
                s = torch.matmul(qf[:, :, qs], kf[:, :, ks].transpose(-1, -2)) * scale
                p = torch.exp(s - safe_lse[:, :, qs, None])
                if mask is not None:
                    p = p.masked_fill(~mask, 0.0)
                dv[:, :, ks] += torch.matmul(p.transpose(-1, -2), do[:, :, qs])
                ds = p * (torch.matmul(do[:, :, qs], vf[:, :, ks].transpose(-1, -2)) - delta[:, :, qs, None])
                dq[:, :, qs] += torch.matmul(ds, kf[:, :, ks]) * scale
                dk[:, :, ks] += torch.matmul(ds.transpose(-1, -2), qf[:, :, qs]) * scale
            dkv[0] += _fold(dk, groups)
            dkv[1] += _fold(dv, groups)
            for work in works:
                work.wait()
            kv = nxt if nxt is not None else kv
            # the accumulated gradients follow their block to the next rank; after the last step
            # this send brings each block's gradients home to its owner
            dkv, acc_works = ring.rotate(dkv)
            for work in acc_works:
                work.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None
