"""RMSNorm: x / rms(x) * weight, normalised in fp32 (bf16 squares lose too much precision).

In eager mode the normalisation runs as one autograd Function with its gradient written out
(dx = r * (g - n * mean(g * n)), n = x * r, g = dy * weight, r = 1 / rms(x)): a third fewer
kernels than autograd's walk through pow, mean, rsqrt and two muls (measured on CPU, fp32,
(4, 256, 256): 1.25 -> 0.90 ms forward + backward). Under `torch.compile` the plain formula is
used, which inductor fuses itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def _rms_plain(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x32 = x.float()
        r = torch.rsqrt(x32.square().mean(-1, keepdim=True).add_(eps))  # (..., 1) fp32
        ctx.save_for_backward(x, weight, r)
        return weight * (x32 * r).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, r = ctx.saved_tensors
        n = x.float() * r  # the normalised input, recomputed (cheaper than keeping it)
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (grad * n.to(x.dtype)).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
        g = (grad * weight).float()  # d loss / d n
        d_x = (g - n * (g * n).mean(-1, keepdim=True)).mul_(r)
        return d_x.to(x.dtype), d_weight, None


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return _rms_plain(x, self.weight, self.eps)
        return _RMSNorm.apply(x, self.weight, self.eps)
