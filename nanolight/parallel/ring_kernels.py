"""Ring attention's block kernels: one (query chunk, key chunk) block -> its output and the
row-wise log-sum-exp, and the block's gradients given the whole row's output and log-sum-exp.

Why a kernel of its own: SDPA returns neither the log-sum-exp that merging partial results needs
nor takes it back in backward, so the ring (`parallel/ring_attention.py`) calls the fused kernels
beneath it directly: CUDA's flash kernel (bf16/fp16, one document), FlexAttention over each
query's key range (documents, fp32 on CUDA: tiles of other documents skipped, no (c x c) mask or
scores), the CPU's flash kernel (a dense mask: it takes no ranges). `MathKernel`, exact attention
with fp32 scores, is the reference they are tested against and the fallback elsewhere. Each takes
grouped-query K/V as they are (kv_heads of them): the kernel maps query head h to kv head
h // (heads / kv_heads), so no block copies K or V per query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanolight.models.attention import FLASH_DTYPES, flex, range_block_mask


@dataclass
class Block:
    """One (query chunk, key chunk) block: (B, H, c, D) q, (B, kv_heads, c, D) k and v, whether it
    is the causal diagonal, the first key each query sees ((B, c); None: one document, every
    key) and the scale."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    first: torch.Tensor | None
    scale: float

    def visible(self) -> torch.Tensor | None:
        """(B or 1, 1, c, c) bool: which keys each query sees, None when all of them. The dense
        form, for the kernels that take no ranges (the CPU's, the math one)."""
        c, device = self.q.shape[2], self.q.device
        mask = torch.ones(c, c, dtype=torch.bool, device=device).tril()[None, None] if self.causal else None
        if self.first is not None:
            seen = (torch.arange(c, device=device)[None, None, :] >= self.first[:, :, None])[:, None]
            mask = seen if mask is None else seen & mask
        return mask

    def sees_any(self) -> torch.Tensor:
        """(B or 1, 1, c) bool: the query sees some key of the block."""
        c, device = self.q.shape[2], self.q.device
        last = torch.arange(c, device=device) if self.causal else torch.full((c,), c - 1, device=device)
        first = self.first if self.first is not None else torch.zeros(1, c, dtype=torch.long, device=device)
        return (first <= last)[:, None]

    def grouped_q(self) -> torch.Tensor:
        """q as (B, kv_heads, groups * c, D): the query heads of one kv head stacked along the rows,
        so one matmul per kv head serves them all (the same product as a per-head K copy)."""
        B, H, c, D = self.q.shape
        return self.q.reshape(B, self.k.shape[1], H // self.k.shape[1] * c, D)

    def grouped_mask(self) -> torch.Tensor | None:
        """`visible` for grouped scores viewed as (B, kv_heads, groups, c, c)."""
        mask = self.visible()
        return None if mask is None else mask[:, :, None]


class MathKernel:
    """Exact attention with the scores written out in fp32: any device, dtype and mask. The
    reference the fused kernels are tested against, and the fallback where none applies."""

    def forward(self, b: Block) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (B, H, c, D) output and (B, H, c) log-sum-exp; -inf for a row that sees no key."""
        B, H, c, D = b.q.shape
        s = torch.matmul(b.grouped_q().float(), b.k.float().transpose(-1, -2)) * b.scale  # (B, kv, g*c, c)
        mask = b.grouped_mask()
        if mask is not None:
            s = s.unflatten(2, (-1, c)).masked_fill(~mask, float("-inf")).flatten(2, 3)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        return torch.matmul(p, b.v.float()).view(B, H, c, D), lse.view(B, H, c)

    def backward(
        self, b: Block, do: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 dq (q's heads), dk, dv (kv heads) of one block, given the merged output and
        log-sum-exp of the whole row."""
        B, H, c, D = b.q.shape
        rows = b.k.shape[1], H // b.k.shape[1] * c  # grouped: (kv_heads, groups * c)
        qf, kf, vf = b.grouped_q().float(), b.k.float(), b.v.float()
        do = do.float().reshape(B, *rows, D)
        p = torch.exp(torch.matmul(qf, kf.transpose(-1, -2)) * b.scale - lse.reshape(B, *rows, 1))
        mask = b.grouped_mask()
        if mask is not None:
            p = p.unflatten(2, (-1, c)).masked_fill(~mask, 0.0).flatten(2, 3)
        # rowsum(dO * O): softmax's backward correction
        delta = (do * out.float().reshape(B, *rows, D)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta)
        return (
            (torch.matmul(ds, kf) * b.scale).view(B, H, c, D),
            torch.matmul(ds.transpose(-1, -2), qf) * b.scale,
            torch.matmul(p.transpose(-1, -2), do),
        )


CPU_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what PyTorch's CPU flash kernel takes


def additive_mask(sees: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: the key is seen) as the additive bias the CPU kernel takes: 0 where
    seen, -inf where not."""
    return torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill_(~sees, float("-inf"))


class CpuFlashKernel:
    """PyTorch's CPU flash-attention kernel (what SDPA runs on CPU), called directly for what SDPA
    does not return: the log-sum-exp, which its backward takes back. No (c x c) scores held; the
    kernel takes no key ranges, so a documents' block gets their dense (B, 1, c, c) additive mask.
    A row that sees no key comes back with output 0 and log-sum-exp 0; it is set to -inf so the
    merge ignores it."""

    def forward(self, b: Block) -> tuple[torch.Tensor, torch.Tensor]:
        bias = None if b.first is None else additive_mask(b.visible(), b.q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            b.q, b.k, b.v, 0.0, b.causal and bias is None, attn_mask=bias, scale=b.scale
        )
        if b.first is not None:
            lse = lse.masked_fill(~b.sees_any(), float("-inf"))
        return out.float(), lse

    def backward(
        self, b: Block, do: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bias = None if b.first is None else additive_mask(b.visible(), b.q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.to(b.q.dtype), b.q, b.k, b.v, out.to(b.q.dtype), lse.contiguous(), 0.0,
            b.causal and bias is None, attn_mask=bias, scale=b.scale,
        )  # fmt: skip
        return dq.float(), dk.float(), dv.float()


class CudaFlashKernel:
    """PyTorch's CUDA flash-attention kernel (what SDPA runs for fp16/bf16 without a mask), which
    returns the log-sum-exp and takes it back in its backward. Blocks with a documents' mask go
    to `FlexKernel` (this kernel takes no mask). The forward's bookkeeping outputs (cumulative
    lengths, RNG state: unused without dropout) are kept and handed back to the backward, as
    SDPA's own autograd formula does."""

    def __init__(self) -> None:
        self._rest: tuple | None = None

    def forward(self, b: Block) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse, cum_q, cum_k, _, _, rng_state, unused, _ = (
            torch.ops.aten._scaled_dot_product_flash_attention(
                b.q, b.k, b.v, 0.0, b.causal, False, scale=b.scale
            )
        )
        self._rest = (cum_q, cum_k, rng_state, unused)
        return out.float(), lse

    def backward(
        self, b: Block, do: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cum_q, cum_k, rng_state, unused = self._rest
        c = b.q.shape[2]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do.to(b.q.dtype).contiguous(), b.q, b.k, b.v, out.to(b.q.dtype).contiguous(),
            lse.contiguous(), cum_q, cum_k, c, c, 0.0, b.causal, rng_state, unused, scale=b.scale,
        )  # fmt: skip
        return dq.float(), dk.float(), dv.float()


def flex_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: Block
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention over one block: (B, H, c, D) output and (B, H, c) log-sum-exp, each query's
    keys one range (`models/attention.py` `range_block_mask`: tiles, no (c x c) mask)."""
    B, _, c, _ = q.shape
    first = b.first if b.first is not None else torch.zeros(B, c, dtype=torch.long, device=q.device)
    return flex(q, k, v, range_block_mask(first, b.causal), scale=b.scale, return_lse=True)


class FlexKernel:
    """FlexAttention for the blocks CUDA's flash kernel does not take (packed documents, fp32):
    each query's keys are one range, so tiles of other documents are skipped and no (c x c) mask
    or scores exist. Its backward is autograd's through the block recomputed: given the output
    gradient w * dO and the log-sum-exp gradient w * (rowsum(dO * o) - rowsum(dO * O)), with
    w = exp(lse - LSE) the block's share of the whole row (o, lse: the block's; O, LSE: the row's),
    the block's gradients are exactly its part of the row's. `attend`: the block's (output,
    log-sum-exp) as an autograd function, `flex_block` (compiled FlexAttention) by default."""

    def __init__(self, attend=flex_block) -> None:  # noqa: ANN001 (a function like flex_block)
        self.attend = attend

    def _run(self, b: Block, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, lse = self.attend(q, k, v, b)
        return out, lse.masked_fill(~b.sees_any(), float("-inf"))  # no key: -inf, whatever the kernel says

    def forward(self, b: Block) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            out, lse = self._run(b, b.q, b.k, b.v)
        return out.float(), lse.float()

    def backward(
        self, b: Block, do: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (t.detach().requires_grad_() for t in (b.q, b.k, b.v))
        with torch.enable_grad():
            block_out, block_lse = self._run(b, q, k, v)
        share = torch.where(torch.isinf(block_lse), 0.0, block_lse.float() - lse).exp()
        share = share.masked_fill(torch.isinf(block_lse), 0.0)  # (B, H, c)
        do = do.float()
        correction = (do * block_out.float()).sum(-1) - (do * out.float()).sum(-1)
        grads = torch.autograd.grad(
            (block_out, block_lse),
            (q, k, v),
            ((share[..., None] * do).to(block_out.dtype), (share * correction).to(block_lse.dtype)),
        )
        return tuple(g.float() for g in grads)


def block_kernel(q: torch.Tensor, masked: bool) -> MathKernel | CpuFlashKernel | CudaFlashKernel | FlexKernel:
    """The fused kernel the device has for these inputs, else the exact math one."""
    if q.device.type == "cpu" and q.dtype in CPU_FLASH_DTYPES:
        return CpuFlashKernel()
    if q.device.type == "cuda":
        return CudaFlashKernel() if q.dtype in FLASH_DTYPES and not masked else FlexKernel()
    return MathKernel()
