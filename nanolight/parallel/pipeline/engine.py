"""`PipelineEngine`: run one optimizer step's micro-batches through the pipeline schedule.

Every stage walks its own schedule (`schedules.py`) and calls the trainer's `micro_step` for
each forward -- so hooks, the user's `training_step` and `self.log` run on every rank, once per
micro-batch, in schedule order -- and `micro_step.backward` for each backward, which
back-propagates the stage (the placeholder loss on non-last stages pulls in the gradient the
next stage sent; see `stage.py`).

After the schedule, the loss: only the last stage computed it; it broadcasts the
per-micro-batch losses to its pipeline group, so every rank returns the true mean loss of the
step (the trainer's `train/loss`, NaN checks and progress bar see the real value everywhere).

Tied embeddings (`sum_tied_grads`, called by the strategy once the step's gradients are
final, i.e. after any data-parallel reduction that writes into ``param.grad``): the first
stage's embedding and the last stage's lm_head are two copies of one weight; their gradients
are summed over the 2-rank {first, last} group, so both copies take the same optimizer step
and stay identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from nanolight.parallel.pipeline.schedules import FORWARD, build_schedule
from nanolight.parallel.pipeline.split import check_micro_batches
from nanolight.parallel.pipeline.stage import PipelineStage


class PipelineEngine:
    """Drives one `PipelineStage` through `schedule` ("1f1b" or "afab") for each step.

    `pp_group` / `last_stage_rank`: this rank's pipeline group and the global rank of its last
    stage. `tied_weight()` returns this stage's copy of a weight shared by the first and last
    stage (None when there is none here), `tie_group` the {first, last} group that sums it.
    """

    def __init__(
        self,
        stage: PipelineStage,
        schedule: str,
        pp_group: Any,
        last_stage_rank: int,
        tied_weight: Callable[[], torch.Tensor | None] = lambda: None,
        tie_group: Any = None,
    ) -> None:
        self.stage, self.schedule = stage, schedule
        self.pp_group, self.last_stage_rank = pp_group, last_stage_rank
        self.tied_weight, self.tie_group = tied_weight, tie_group
        self.max_in_flight = 0  # most micro-batches whose activations were alive at once, last step
        self._checked = False

    def run(self, micro_batches: Sequence[Any], micro_step: Any) -> torch.Tensor:
        """Forward and backward every micro-batch; returns the step's true mean loss on every rank."""
        stage, m = self.stage, len(micro_batches)
        if not self._checked:  # the first step has accumulate_grad_batches micro-batches
            check_micro_batches(stage.pp_size, self.schedule, m)
            self._checked = True
        losses: dict[int, torch.Tensor] = {}
        self.max_in_flight = 0
        for kind, i in build_schedule(self.schedule, m, stage.pp_size, stage.pp_rank):
            if kind == FORWARD:
                stage.current = i
                try:
                    losses[i] = micro_step(micro_batches[i], i)  # hooks + the user's training_step
                finally:
                    stage.current = None
                self.max_in_flight = max(self.max_in_flight, len(stage.in_flight))
            else:
                loss = losses[i]
                # scale by 1/m as the plain accumulation loop does; the last stage's scaled
                # gradient flows back through every earlier stage unchanged
                stage.backward(i, loss / m, lambda scaled, i=i: micro_step.backward(scaled, i))
                losses[i] = loss.detach()
        stage.p2p.wait()  # every activation/gradient this stage sent has been received
        return self._true_mean_loss([losses[i] for i in range(m)])

    def sum_tied_grads(self) -> None:
        """Sum the tied weight's gradient over the first and last stage (no-op elsewhere)."""
        weight = self.tied_weight()
        if self.tie_group is None or weight is None:
            return
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        # first stage (embedding grad) and last stage (lm_head grad) exchange and sum theirs
        dist.all_reduce(weight.grad, group=self.tie_group)

    def _true_mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        values = torch.stack([loss.float().reshape(()) for loss in losses])
        if self.stage.pp_size > 1:
            # the last stage sends its per-micro-batch losses to every stage of its pipeline
            dist.broadcast(values, src=self.last_stage_rank, group=self.pp_group)
        return values.mean()

    def broadcast_from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """A metric as the last stage computed it (placeholders on other stages are replaced)."""
        out = value.detach().float().clone()
        # the last stage sends its value to every stage of its pipeline
        dist.broadcast(out, src=self.last_stage_rank, group=self.pp_group)
        return out
