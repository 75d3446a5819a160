"""Rotary position embeddings (RoPE), with Llama 3's frequency scaling.

Convention (matches HF transformers' Llama, so converted weights need no permutation): a head
vector is split into two halves [x1, x2] and rotated as [x1*cos - x2*sin, x2*cos + x1*sin],
with frequency i shared by dims i and i + head_dim/2 ("rotate_half"), not interleaved pairs.

The tables are recomputed every forward from the config instead of being cached in a buffer:
it costs a (T, head_dim) outer product, and it keeps the model free of non-persistent buffers
that a meta-device build + `to_empty()` would leave uninitialised.
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None, device=None) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/head_dim), i < head_dim/2, llama3-scaled if asked. (head_dim/2,)"""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 "NTK-by-parts": keep high frequencies, divide low ones by `factor`, blend between.

    Wavelengths shorter than original_len/high_freq_factor are untouched; longer than
    original_len/low_freq_factor are slowed by `factor`; the band in between is interpolated
    linearly in original_len/wavelength. (Meta's reference and HF's `_compute_llama3_parameters`.)
    """
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, scaled)


def rope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for the given positions. position_ids (B, T) -> two (B, T, head_dim)."""
    freqs = position_ids[..., None].float() * inv_freq.float()  # (B, T, head_dim/2), fp32 for long contexts
    angles = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim): dims i and i+head_dim/2 share a frequency
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[x1*cos - x2*sin, x2*cos + x1*sin] (full-width cos, half-width sin) written into one new
    contiguous tensor of x's dtype in three ops: x*cos over the whole head (both halves share the
    frequencies), then each half's sin term added in place -- no rotate_half copy, no
    concatenation, no negation. Half-precision x with fp32 tables (autocast): computed in fp32,
    rounded once into x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    if x.dtype == torch.result_type(x, cos):
        torch.mul(x, cos, out=out)
        o1.addcmul_(x2, sin, value=-1)
        o2.addcmul_(x1, sin)
    else:
        scaled = x * cos  # fp32
        torch.addcmul(scaled[..., :half], x2, sin, value=-1, out=o1)
        torch.addcmul(scaled[..., half:], x1, sin, out=o2)
    return out


class _Rope(torch.autograd.Function):
    """A rotation's gradient is the inverse rotation (sin negated): backward is one more `_rotate`.
    cos is full width (head_dim), sin half width (see `_rotate`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, ..., head_dim) -- tokens first, any head dims after -- by position; cos/sin
    are (B or 1, T, head_dim). Returns a contiguous tensor (heads then merge without a copy) of
    x's dtype: under autocast the tables are fp32 while q and k are the projections' bf16, and
    q, k, v must reach the attention kernel in one dtype (flash-attn takes nothing else)."""
    half = x.shape[-1] // 2
    shape = (*cos.shape[:2], *([1] * (x.dim() - 3)), -1)  # broadcast over the head dims
    c, s = cos.reshape(shape), sin[..., :half].reshape(shape)  # sin's halves are equal: one kept
    if torch.compiler.is_compiling():
        x1, x2 = x[..., :half], x[..., half:]  # plain ops: inductor fuses them into one kernel
        c = c[..., :half]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return _Rope.apply(x, c, s)
