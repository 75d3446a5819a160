"""`measure_flops` (Lightning's, from ``lightning.fabric.utilities.throughput``): the FLOPs a
model's forward (and, given a loss, its backward) costs, counted by torch's `FlopCounterMode`, so
a module can set the ``flops_per_batch`` that `ThroughputMonitor` reads. Build the model on the
``meta`` device to count without computing."""

from __future__ import annotations

from collections.abc import Callable

import torch


def measure_flops(
    model: torch.nn.Module,
    forward_fn: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """FLOPs of ``forward_fn()``, plus ``loss_fn(output).backward()`` when `loss_fn` is given.
    `model` is what `forward_fn` runs (Lightning's signature; the counter sees every op)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        out = forward_fn()
        if loss_fn is not None:
            loss_fn(out).backward()
    return counter.get_total_flops()
