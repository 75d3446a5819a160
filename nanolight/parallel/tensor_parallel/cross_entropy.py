"""Vocab-parallel cross-entropy: the loss over logits sharded on the vocabulary dimension.

Why: the lm_head is column-parallel, so rank r holds logits for ids [r*V/tp, (r+1)*V/tp) only.
Gathering them would materialise (tokens x V) on every rank — for SmolLM's 49k vocabulary
that is the largest activation in the model. Instead, the softmax statistics are combined
with two small all-reduces over (tokens,) vectors:

    m      = max_r  max_v logits_r[:, v]                      all-reduce MAX
    s, z_t = sum_r (sum_v exp(logits_r - m)), target logit    all-reduce SUM (one, stacked)
    loss   = mean (or sum) over valid tokens of  log(s) - (z_t - m)

Backward needs no communication: d loss / d logits_r = (softmax_r - onehot_r) / n_valid (mean)
or (softmax_r - onehot_r) (sum). Matches `F.cross_entropy(logits, target, ignore_index=-100,
reduction=...)`.

The model's training loss does not take that path: `VocabParallelCrossEntropyLoss.head_loss`
runs the output head and the loss together over chunks of tokens (`models/fused_loss.py`, the
one chunked loss), so neither the (tokens x V/tp) fp32 logits nor their softmax are held for
backward -- per chunk, the tp ranks exchange each token's log-sum-exp over their slice and its
target logit (one all-gather of (2, chunk)). The loss over given logits stays for callers that
have them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from nanolight.models.fused_loss import linear_cross_entropy
from nanolight.parallel.tensor_parallel.comm import all_gather_tensor, tp_world
from nanolight.parallel.tensor_parallel.layers import ColumnParallelLinear


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, target: Tensor, group: Any, ignore_index: int, mean: bool
    ) -> Tensor:
        rank, size = tp_world(group)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        vocab_local = logits.shape[-1]
        start = rank * vocab_local
        logits = logits.reshape(-1, vocab_local).float()
        target = target.reshape(-1)

        # tp ranks exchange their per-token max logit (MAX): a common shift keeps exp() finite.
        max_logit = logits.max(dim=-1).values
        if size > 1:
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - max_logit.unsqueeze(-1)

        owned = (target >= start) & (target < start + vocab_local)
        local_target = (target - start).masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        exp = shifted.exp()
        stats = torch.stack([exp.sum(dim=-1), target_logit])  # (2, tokens)
        # tp ranks exchange partial sum-exp and the target logit (only its owner's is nonzero).
        if size > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target_logit = stats[0], stats[1]

        valid = target != ignore_index
        # the mean's divisor (NaN when no token is valid, like F.cross_entropy), or 1 for the sum
        n_valid = valid.sum() if mean else torch.ones((), dtype=torch.int64, device=valid.device)
        per_token = (torch.log(sum_exp) - target_logit).masked_fill(~valid, 0.0)
        loss = per_token.sum() / n_valid

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, owned, valid, n_valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        softmax, local_target, owned, valid, n_valid = ctx.saved_tensors
        grad = softmax  # reuse the saved buffer: backward runs once
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= owned.to(grad.dtype)
        grad.mul_((valid.to(grad.dtype) * (grad_loss / n_valid)).unsqueeze(-1))
        return grad.view(ctx.logits_shape).to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, group: Any, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """Cross-entropy of vocab-sharded `logits` (..., V/tp) against full-vocab `target` (...): the
    mean over valid tokens, or (``reduction="sum"``) their sum."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on token dims"
        )
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index, reduction == "mean")


def vocab_parallel_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    group: Any,
    reduction: str = "mean",
    rows: int | None = None,
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T`` where `weight` (V/tp, H) is this rank's vocabulary
    slice (ids [rank * V/tp, ...)) and `hidden` the head's input as every tp rank holds it: the
    fused, chunked loss (`models/fused_loss.py`, `rows` tokens a chunk), its per-token statistics
    gathered over tp."""
    rank, size = tp_world(group)

    def gather(stats: Tensor) -> Tensor:  # (n, 2) -> (tp, n, 2)
        if size == 1:
            return stats[None]
        # tp ranks exchange each token's log-sum-exp over their vocabulary slice and target logit
        return all_gather_tensor(stats[None], 0, group)

    return linear_cross_entropy(
        hidden, weight, target, rows, reduction, vocab_start=rank * weight.shape[0], gather=gather
    )


class VocabParallelCrossEntropyLoss(nn.Module):
    """`model.loss_fn` under tensor parallelism: `loss_fn(local_logits, labels, reduction) -> loss`,
    and `head_loss(head, hidden, labels, reduction)`: the column-parallel output head and the loss
    in one chunked pass (no logits held), which the model's training loss calls."""

    def __init__(self, group: Any, ignore_index: int = -100) -> None:
        super().__init__()
        self.group, self.ignore_index = group, ignore_index

    def forward(self, logits: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
        return vocab_parallel_cross_entropy(logits, target, self.group, self.ignore_index, reduction)

    def head_loss(
        self,
        head: ColumnParallelLinear,
        hidden: Tensor,
        target: Tensor,
        reduction: str = "mean",
        rows: int | None = None,
    ) -> Tensor:
        if self.ignore_index != -100:  # the fused loss ignores -100, the model's convention
            return self(head(hidden), target, reduction)
        x = head.entry(hidden)  # the whole sequence on every tp rank; d x summed over tp in backward
        return vocab_parallel_linear_cross_entropy(x, head.weight, target, self.group, reduction, rows)
