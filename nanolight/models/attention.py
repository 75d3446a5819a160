"""Causal attention kernels behind one call: flash-attn, PyTorch SDPA, or the textbook formula.

`attend(q, k, v, implementation)` takes (B, heads, T, head_dim) queries and (B, kv_heads, T,
head_dim) keys/values (grouped-query attention: each kv head serves ``heads // kv_heads``
consecutive query heads) and returns (B, heads, T, head_dim). The model picks the implementation
by name (`LlamaConfig.attn_implementation`); the availability check runs when the model is built.
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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, implementation: str) -> torch.Tensor:
    if implementation == "flash_attention_2":
        from flash_attn import flash_attn_func  # optional dependency, checked at build time

        # flash-attn wants (B, T, heads, head_dim) and handles GQA itself.
        y = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return y.transpose(1, 2)
    r = q.size(1) // k.size(1)
    if implementation == "sdpa" and _SDPA_HAS_GQA:
        # sdpa maps query head h to kv head h // r itself, without materialising copies of k, v.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=r > 1)
    # Each kv head serves the r consecutive query heads of its group.
    k = k.repeat_interleave(r, dim=1)  # (B, heads, T, head_dim)
    v = v.repeat_interleave(r, dim=1)
    if implementation == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # eager: the textbook formula, kept as the reference the fused kernels are tested against.
    T = q.size(2)
    att = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5)  # (B, heads, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    att = att.masked_fill(future, float("-inf"))
    att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
    return att @ v
