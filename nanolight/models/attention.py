"""Causal attention kernels behind one call: flash-attn, PyTorch SDPA, or the textbook formula.

`attend(q, k, v, implementation)` takes (B, heads, T, head_dim) queries and (B, kv_heads, T,
head_dim) keys/values (grouped-query attention: each kv head serves ``heads // kv_heads``
consecutive query heads) and returns (B, heads, T, head_dim). The model picks the implementation
by name (`LlamaConfig.attn_implementation`); the availability check runs when the model is built.

Packed rows with `Documents`: a token attends only to earlier tokens of its own document -- a
block-diagonal causal mask for SDPA and eager, flash-attn's variable-length kernel (one sequence
per document, offsets `cu_seqlens`) on a GPU -- so packing changes no document's result.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

_SDPA_HAS_GQA = torch.__version__ >= "2.5"  # `enable_gqa` argument of scaled_dot_product_attention


def flash_attn_available() -> bool:
    """True when the flash-attn package is importable and a CUDA GPU is present."""
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


def check_attn_implementation(name: str) -> None:
    """Fail at build time, not at the first forward on 512 GPUs."""
    if name == "flash_attention_2" and not flash_attn_available():
        raise RuntimeError(
            "attn_implementation='flash_attention_2' needs the flash-attn package and a CUDA GPU "
            f"(flash-attn installed: {importlib.util.find_spec('flash_attn') is not None}, "
            f"CUDA available: {torch.cuda.is_available()}); install it with `pip install nanolight[flash]` "
            "on a GPU machine or use attn_implementation='sdpa'"
        )


class Documents:
    """Which document each token of packed rows belongs to: `ids` (B, T), equal within a document.
    The mask or the offsets are built once per forward and shared by every layer; `prepare`
    builds them before the layers run, so a (compiled, recomputed) layer only reads them."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self._mask: torch.Tensor | None = None
        self._varlen: tuple[torch.Tensor, int] | None = None

    def prepare(self, implementation: str) -> Documents:
        """Build what `attend` will read for this implementation; returns self."""
        if implementation == "flash_attention_2":
            self.varlen()
        else:
            self.mask()
        return self

    def mask(self) -> torch.Tensor:
        """(B, 1, T, T) bool: query i may attend key j (same document, j <= i)."""
        if self._mask is None:
            T = self.ids.shape[1]
            same = self.ids[:, :, None] == self.ids[:, None, :]  # (B, T, T)
            causal = torch.ones(T, T, dtype=torch.bool, device=self.ids.device).tril()
            self._mask = (same & causal)[:, None]
        return self._mask

    def varlen(self) -> tuple[torch.Tensor, int]:
        """flash-attn's (cu_seqlens, max_seqlen) over the flattened (B * T) tokens: every document
        of every row is its own sequence."""
        if self._varlen is not None:
            return self._varlen
        B, T = self.ids.shape
        starts = torch.ones_like(self.ids, dtype=torch.bool)
        starts[:, 1:] = self.ids[:, 1:] != self.ids[:, :-1]  # a row start is a document start
        first = starts.reshape(-1).nonzero().squeeze(-1)
        cu = torch.cat([first, torch.tensor([B * T], device=first.device)]).to(torch.int32)
        self._varlen = cu, int((cu[1:] - cu[:-1]).max())
        return self._varlen


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None) -> torch.Tensor:
    import flash_attn  # optional, checked at build time

    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, T, heads, head_dim); GQA built in
    if documents is None:
        return flash_attn.flash_attn_func(q, k, v, causal=True).transpose(1, 2)
    B, T = q.shape[:2]
    cu, longest = documents.varlen()
    flat = [t.reshape(B * T, *t.shape[2:]) for t in (q, k, v)]
    y = flash_attn.flash_attn_varlen_func(
        *flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=True
    )
    return y.reshape(B, T, *y.shape[1:]).transpose(1, 2)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, implementation: str, documents: Documents | None = None
) -> torch.Tensor:
    if implementation == "flash_attention_2":
        return _flash(q, k, v, documents)
    r = q.size(1) // k.size(1)
    mask = documents.mask() if documents is not None else None
    if implementation == "sdpa" and _SDPA_HAS_GQA:
        # sdpa maps query head h to kv head h // r itself, without materialising copies of k, v.
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=r > 1
        )
    # Each kv head serves the r consecutive query heads of its group.
    k = k.repeat_interleave(r, dim=1)  # (B, heads, T, head_dim)
    v = v.repeat_interleave(r, dim=1)
    if implementation == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    # eager: the textbook formula, kept as the reference the fused kernels are tested against.
    T = q.size(2)
    att = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5)  # (B, heads, T, T)
    allowed = mask if mask is not None else torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~allowed, float("-inf"))
    att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
    return att @ v
