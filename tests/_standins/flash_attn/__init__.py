"""A stand-in for the flash-attn package on a machine without a GPU: the real kernels' input
checks, the result computed with PyTorch's SDPA.

The checks mirror flash-attn 2's `csrc/flash_attn/flash_api.cpp` (`mha_fwd`, `mha_varlen_fwd`,
`mha_bwd`): fp16/bf16 only, q, k, v (and the incoming gradient) of one dtype, a contiguous last
dimension, head_dim at most 256 and a multiple of 8, kv heads dividing query heads; varlen:
`cu_seqlens` int32, contiguous, on q's device, `max_seqlen` a Python int. A call that the real
kernel would reject raises RuntimeError with the kernel's message. `calls` records each call:
the function, q's and k's shapes, and the varlen offsets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__version__ = "2.7.0-standin"
calls: list[dict] = []


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _require(
        q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type"
    )
    _require(k.dtype == q.dtype, "query and key must have the same dtype")
    _require(v.dtype == q.dtype, "query and value must have the same dtype")
    for t in (q, k, v):
        _require(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    head_dim = q.shape[-1]
    _require(head_dim <= 256, "FlashAttention forward only supports head dimension at most 256")
    _require(head_dim % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    _require(
        q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query"
    )


def _check_grad_on_backward(out: torch.Tensor) -> torch.Tensor:
    """mha_bwd: the incoming gradient has the inputs' dtype and a contiguous last dimension."""
    if out.requires_grad:
        dtype = out.dtype

        def check(grad: torch.Tensor) -> None:
            _require(grad.dtype == dtype, "query and dout must have the same dtype")
            _require(grad.stride(-1) == 1, "dout tensor must have contiguous last dimension")

        out.register_hook(check)
    return out


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
) -> torch.Tensor:
    """(T, heads, head_dim) or (B, T, heads, head_dim) -> same layout, via SDPA (heads first)."""
    y = F.scaled_dot_product_attention(
        q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), is_causal=causal, scale=scale,
        enable_gqa=q.shape[-2] != k.shape[-2],
    )  # fmt: skip
    return y.transpose(-3, -2)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    **unused: object,
) -> torch.Tensor:
    """q (B, T, heads, head_dim), k and v (B, T, kv_heads, head_dim)."""
    calls.append({"fn": "flash_attn_func", "q": tuple(q.shape), "k": tuple(k.shape)})
    _check_inputs(q, k, v)
    _require(q.dim() == 4, "q must have shape (batch_size, seqlen, num_heads, head_size)")
    return _check_grad_on_backward(_sdpa(q, k, v, causal, softmax_scale).contiguous())


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    **unused: object,
) -> torch.Tensor:
    """q (total, heads, head_dim), k and v (total, kv_heads, head_dim); sequence i is rows
    cu_seqlens[i]:cu_seqlens[i+1]."""
    calls.append(
        {
            "fn": "flash_attn_varlen_func",
            "q": tuple(q.shape),
            "k": tuple(k.shape),
            "cu_seqlens": cu_seqlens_q.tolist(),
        }
    )
    _check_inputs(q, k, v)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _require(cu.dtype == torch.int32, f"{name} must have dtype int32")
        _require(cu.device == q.device, f"{name} must be on the device of q")
        _require(cu.is_contiguous(), f"{name} must be contiguous")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        _require(type(n) is int, f"{name} must be a Python int, got {type(n).__name__}")
    _require(torch.equal(cu_seqlens_q, cu_seqlens_k), "the stand-in computes self-attention only")
    bounds = cu_seqlens_q.tolist()
    _require(
        max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)) <= max_seqlen_q,
        "max_seqlen_q too small",
    )
    pieces = [
        _sdpa(q[a:b], k[a:b], v[a:b], causal, softmax_scale)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return _check_grad_on_backward(torch.cat(pieces))
