"""One batch under manual optimization (``automatic_optimization = False``): the module's
``training_step`` drives its optimizers -- ``self.optimizers()``, ``self.manual_backward(loss)``
(backward hooks included), ``opt.step()`` (the gradients are finished, ``on_before_optimizer_step``
runs, ``global_step`` counts it), ``opt.zero_grad()``, and its own schedulers. As in Lightning
the trainer neither zeroes, clips nor steps anything itself. Not under pipeline parallelism: a
1F1B schedule interleaves micro-batches that a hand-written step cannot see.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nanolight.trainer.data_position import count_consumed
from nanolight.trainer.step import END_EPOCH

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer


def manual_outputs(output: Any) -> dict[str, Any]:
    """What on_train_batch_end receives (Lightning's manual result: the step's dict, or its loss)."""
    if isinstance(output, torch.Tensor):
        return {"loss": output.detach()}
    if isinstance(output, dict):
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in output.items()}
    return {}


class ManualStep:
    def __init__(self, trainer: NanoTrainer) -> None:
        self.trainer = trainer

    def run(self, batches: list[Any], first: int, last_of_epoch: bool) -> bool:
        trainer = self.trainer
        (raw,) = batches
        batch = trainer.transfer_batch(raw)
        trainer.metrics.batch, trainer.fit_loop.batch_idx = batch, first
        if trainer.call_hook("on_train_batch_start", batch, first, returns=True) == END_EPOCH:
            return False
        with trainer.strategy.autocast():
            output = trainer.call_step("training_step", batch, first)
        count_consumed(trainer.progress, batches, trainer.strategy.data_parallel_size)
        trainer.publish_step(sync=True)
        trainer.call_hook("on_train_batch_end", manual_outputs(output), batch, first)
        return True
