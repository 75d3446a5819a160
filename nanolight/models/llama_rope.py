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


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[x1*cos - x2*sin, x2*cos + x1*sin] (full-width cos, half-width sin) written into `out` (a
    new contiguous tensor of x's dtype unless given) in three ops: x*cos over the whole head (both
    halves share the frequencies), then each half's sin term added in place -- no rotate_half
    copy, no concatenation, no negation. Half-precision x with fp32 tables (autocast): computed
    in fp32, rounded once into x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    if out.dtype == torch.result_type(x, cos):
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


class _RopeQKV(torch.autograd.Function):
    """q and k rotated out of the fused projection's output, v copied, and in backward the
    three gradients written into one buffer shaped like that output (autograd would give three
    tensors and join them with a copy). qkv (B, T, n_kv, r + 2, head_dim): each kv group's r query
    heads, its key, its value (`CausalSelfAttention`'s layout); cos/sin as `_Rope` takes them."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        r = qkv.shape[3] - 2  # cos/sin (B or 1, T, 1, 1, width): broadcast over groups and heads
        ctx.save_for_backward(cos, sin)
        ctx.qkv_shape = qkv.shape
        q = _rotate(qkv[:, :, :, :r], cos, sin)  # (B, T, n_kv, r, head_dim)
        k = _rotate(qkv[:, :, :, r], cos[:, :, :, 0], sin[:, :, :, 0])  # (B, T, n_kv, head_dim)
        # v copied out: a view would keep the whole projection output alive for the attention's
        # backward, q's and k's unrotated rows included ((h + h_kv)·T bytes more per layer)
        return q.flatten(2, 3), k, qkv[:, :, :, r + 1].contiguous()

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        cos, sin = ctx.saved_tensors
        shape = ctx.qkv_shape
        r = shape[3] - 2
        d_qkv = torch.empty(shape, dtype=dq.dtype, device=dq.device)
        _rotate(dq.unflatten(2, (shape[2], r)), cos, -sin, out=d_qkv[:, :, :, :r])
        _rotate(dk, cos[:, :, :, 0], -sin[:, :, :, 0], out=d_qkv[:, :, :, r])
        d_qkv[:, :, :, r + 1].copy_(dv)
        return d_qkv, None, None


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


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k rotated, v as is, from the fused projection's output qkv (B, T, n_kv, r + 2,
    head_dim) (each kv group: r query heads, the key, the value): q (B, T, n_kv * r, head_dim)
    and k (B, T, n_kv, head_dim) and v (B, T, n_kv, head_dim) contiguous; cos/sin (B or 1, T,
    head_dim). Under `torch.compile` the split and `apply_rope`'s plain ops (inductor fuses them)."""
    r = qkv.shape[3] - 2
    if torch.compiler.is_compiling():
        q, k, v = qkv.split((r, 1, 1), dim=3)
        return apply_rope(q, cos, sin).flatten(2, 3), apply_rope(k.squeeze(3), cos, sin), v.squeeze(3)
    shape = (*cos.shape[:2], 1, 1, -1)
    c, s = cos.reshape(shape), sin[..., : qkv.shape[-1] // 2].reshape(shape)  # sin's halves are equal
    return _RopeQKV.apply(qkv, c, s)
