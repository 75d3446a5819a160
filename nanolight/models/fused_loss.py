"""The output head and the cross-entropy in one pass over chunks of tokens (no full logits).

Why: the (tokens, vocab) logits are the largest activation of a small LM (smollm-1.7b at 16k
tokens per micro-batch: 3.2 GB in fp32), and the plain loss walks them five times -- write the
log-softmax, zero-fill its gradient, scatter, read both back, write the gradient. Here each chunk
of tokens computes its logits, its loss and, when training, its gradients at once: the softmax
minus the one-hot *is* the gradient of the logits, so the chunk's contribution to d hidden and
d weight is taken right away and its logits are dropped. Only d hidden (tokens x hidden) and
d weight (the head's size) are kept for backward, which scales them by the incoming gradient.
On CPU a chunk is large (64 MB of logits): every chunk is a round of small kernels, and with
two threads on a busy machine 174-row chunks (a 4 MB budget) ran the head + loss 2x slower
than one 1024-row chunk (vocab 6000, hidden 320; equal on one thread).

Under tensor parallelism the head holds a slice of the vocabulary (rows `vocab_start` onwards):
the same chunks, each token's log-sum-exp over the slice and its target's logit (where this slice
holds the target) gathered from every slice (`gather`, given by the vocab-parallel loss,
`parallel/tensor_parallel/cross_entropy.py`) and combined; nothing else changes.

Numerics are those of ``F.cross_entropy(logits.float(), labels, ignore_index=-100)``: logits in
the compute dtype (autocast's, or the inputs'), softmax in fp32, the mean (or, with
``reduction="sum"``, the sum: the caller divides, `LlamaForCausalLM`) over counted tokens;
d weight is summed over chunks in fp32. Backward runs once (no `retain_graph` double backward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100
CHUNK_BYTES = {"cpu": 64 << 20, "cuda": 256 << 20}  # fp32 logits per chunk: few chunks / memory-bounded


def chunk_rows(vocab: int, hidden: int, device: torch.device) -> int:
    """Tokens per chunk: the logits budget of the device, but at least `hidden / 2` rows so that
    each chunk's update of d weight (vocab x hidden) stays small next to its logits."""
    budget = CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"])
    return max(budget // (4 * vocab), hidden // 2, 1)


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(tensors[0].dtype, tensors[1].dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """loss = mean (or sum) CE(hidden @ weight.T, labels); gradients taken during forward (see
    the module doc)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        rows: int,
        mean: bool,
        grad_enabled: bool,
        vocab_start: int,
        gather: Callable[[Tensor], Tensor] | None,
    ) -> Tensor:
        dtype = _compute_dtype(hidden, weight)
        # `needs_input_grad` says only which inputs require grad; under no_grad (validation) no
        # backward will come, so the caller's grad mode decides whether to take gradients
        want_h, want_w = (grad_enabled and ctx.needs_input_grad[i] for i in (0, 1))
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            valid = labels != IGNORE_INDEX
            local = labels - vocab_start
            owned = valid & (local >= 0) & (local < w.shape[0])  # the target's logit is in this slice
            safe = local.masked_fill(~owned, 0)[:, None]  # (N, 1): an index that exists
            # (N,): the token's weight in the loss -- 1 (sum) or 1/count (mean), 0 where ignored
            keep_all = valid / valid.sum() if mean else valid.float()
            minus_one = -owned.float()[:, None]  # (N, 1): the one-hot, where this slice holds it
            d_hidden = torch.empty_like(hidden) if want_h else None
            d_weight = None
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for s in range(0, hidden.shape[0], rows):
                logits = logp = probs = grad = None  # the last chunk's (n, V) buffers go first
                h, keep, idx = (
                    hidden[s : s + rows].to(dtype),
                    keep_all[s : s + rows, None],
                    safe[s : s + rows],
                )
                logits = (h @ w.t()).float()  # (n, V), or (n, this slice of V)
                if gather is None:
                    # in place: each row's log-softmax is written after the row's max and sum are read
                    logp = torch.log_softmax(logits, dim=-1, out=logits)
                    loss -= (logp.gather(1, idx) * keep).sum()
                    scale = None  # exp(logp) is the softmax
                else:  # every slice's log-sum-exp and target logit (0 where not held): (slices, n, 2)
                    target = logits.gather(1, idx).masked_fill_(~owned[s : s + rows, None], 0.0)
                    top = logits.amax(-1, keepdim=True)
                    # in place, logits -> exp(logits - top): torch.logsumexp would make an (n, V)
                    # temporary for the same sums, and the softmax would take a second exp
                    local = logits.sub_(top).exp_().sum(-1, keepdim=True).log_().add_(top)
                    every = gather(torch.cat([local, target], 1))
                    lse = every[..., :1].logsumexp(0)  # (n, 1) over the whole vocabulary
                    loss -= ((every[..., 1:].sum(0) - lse) * keep).sum()
                    scale = (top - lse).exp_()  # exp(logits - top) * scale: the softmax
                if not (want_h or want_w):
                    continue
                probs = logits.exp_() if scale is None else logits.mul_(scale)
                grad = probs.scatter_add_(1, idx, minus_one[s : s + rows])  # softmax - onehot
                grad = grad.to(dtype)  # d loss / d logits up to the row weights, applied on the H side
                if want_h and d_hidden.dtype == dtype:  # written in place, no temporary
                    torch.mm(grad, w, out=d_hidden[s : s + rows]).mul_(keep)
                elif want_h:  # e.g. fp32 hidden under bf16 autocast: the product cast on the way in
                    d_hidden[s : s + rows] = (grad @ w) * keep
                if want_w:
                    hk = h * keep.to(dtype)
                    if d_weight is None:
                        d_weight = (grad.t() @ hk).float()  # (V, H)
                    elif dtype == torch.float32:
                        d_weight.addmm_(grad.t(), hk)
                    else:
                        d_weight += grad.t() @ hk
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.weight_dtype, ctx.used = weight.dtype, False
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.used:
            raise RuntimeError(
                "linear_cross_entropy's backward runs once (its gradients are scaled in place)"
            )
        ctx.used = True
        d_hidden, d_weight = ctx.saved_tensors
        # the caller's gradient (e.g. 1 / accumulate_grad_batches), applied in place: backward
        # runs once, and these buffers were made for it
        dh = d_hidden.mul_(grad_out) if d_hidden is not None else None
        dw = d_weight.mul_(grad_out).to(ctx.weight_dtype) if d_weight is not None else None
        return dh, dw, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    rows: int | None = None,
    reduction: str = "mean",
    vocab_start: int = 0,
    gather: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against `labels` (-100: not counted), its mean over
    the counted tokens or (``reduction="sum"``) their sum.

    hidden (..., H), weight (V, H), labels (...) aligned with hidden (already shifted).
    `rows`: tokens per chunk (default: `chunk_rows`). A vocabulary slice (tensor parallelism):
    `weight` holds ids [vocab_start, vocab_start + len(weight)), and `gather` maps this slice's
    (n, 2) per-token statistics to every slice's, stacked (slices, n, 2)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    h = hidden.reshape(-1, hidden.shape[-1])
    if rows is None:
        rows = chunk_rows(weight.shape[0], weight.shape[1], hidden.device)
    return _LinearCrossEntropy.apply(
        h, weight, labels.reshape(-1), rows, reduction == "mean", torch.is_grad_enabled(), vocab_start, gather
    )
