"""The step's valid-target count: the causal LM's loss and gradients are the exact token mean of
the global batch at every layout and micro-batch split.

Why. Averaging each micro-batch's *mean* weighs a token by 1 / (its micro-batch's valid targets),
so whenever micro-batches hold different numbers of valid targets (document masking drops each
document's last prediction) the result depends on how the global batch was cut -- into dp ranks,
micro-batches, or context-parallel shards. The exact mean divides every micro-batch's
token *sum* by one count: the step's valid targets over all its micro-batches and every rank of
the loss group (the data-parallel replicas), counted on the whole sequences before context
parallelism splits them (each of its cp ranks then holds 1/cp of the count's tokens).

How it meets the trainer's Lightning arithmetic, which stays as it is for any other loss: the
trainer back-propagates loss_i / n (n micro-batches), the replica reduction averages gradients
over g = dp * cp ranks, and the step's loss is the mean of the micro-batch losses over them.
So micro-batch i's loss is its (share's) sum divided by

    divisor = N / (n * g)        N: valid targets of the step, summed over the dp replicas

-- the step's mean valid targets per micro-batch. Then sum_r sum_i (sum_ri / divisor) / (n g) =
(sum of every token's loss) / N, for the loss and, by linearity, for the gradients. Where every
micro-batch holds the same count, the divisor is each one's own count: the plain mean as before.

The count is made once per step, before its first micro-batch (micro-batch 0's backward needs
it), from the batches' already-shifted `target_ids` (a sequence's targets are known only where
the sequence is whole: `models.llama.shift_labels`), and summed over the group on the device:
no host sync. Batches without `target_ids` (a user's own loss) keep Lightning's semantics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from nanolight.models.fused_loss import IGNORE_INDEX

TARGETS = "target_ids"  # the batch key of already-shifted next-token targets (-100: none)


def step_targets(batches: Sequence[Any]) -> list[torch.Tensor] | None:
    """Every micro-batch's `target_ids`, or None unless each batch is a dict that carries them."""
    if not batches or not all(
        isinstance(b, dict) and isinstance(b.get(TARGETS), torch.Tensor) for b in batches
    ):
        return None
    return [b[TARGETS] for b in batches]


def loss_divisor(
    targets: Sequence[torch.Tensor],
    device: torch.device,
    group: Any = None,
    group_size: int = 1,
    shards: int = 1,
) -> torch.Tensor:
    """The step's valid targets per micro-batch slot, N / (n * g) (see the module docstring): a
    float32 scalar on `device`, summed over `group` (`group_size` ranks) without a host sync.
    `shards`: ranks splitting each of these (whole) sequences under context parallelism; each
    holds a share of the count's tokens and averages with the others, so g = group_size * shards."""
    counts = torch.stack([(t != IGNORE_INDEX).sum() for t in targets])  # where the batches are
    total = counts.sum().to(device, non_blocking=True)  # int64: exact at any token count
    if group_size > 1:
        # the loss group's ranks (dp replicas: different samples) sum their valid-target counts
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return (total.double() / (len(targets) * group_size * shards)).float()
