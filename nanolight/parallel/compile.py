"""`torch.compile` of each decoder block, with its graph breaks reported once.

Per block rather than the whole model (torchtitan's choice): the blocks are identical, so one
compiled graph serves them all (dynamo inlines nn.Modules and treats their parameters as inputs),
compile time does not grow with depth, and what surrounds the blocks -- the embedding, the fused
head + loss, the pipeline's sends and receives, the dp reduction's hooks -- stays eager.
`nn.Module.compile` compiles in place, so module names and state-dict keys are the plain model's.

Order (both strategies' `setup_module`): tensor parallelism, the pipeline split, activation
checkpointing (`recompute.py`: the compiled block traces the checkpoint), then this; data
parallelism wraps the optimizer afterwards. Compilation itself happens at the first forward; a
forward hook on the model then reports how many graphs dynamo made and every graph break with
its reason (`CompiledBlocks.graph_breaks`), as info when there is none, as a warning otherwise.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from nanolight.parallel.blocks import decoder_blocks

log = logging.getLogger(__name__)


def _counters() -> tuple[Counter, int]:
    from torch._dynamo.utils import counters  # dynamo's process-wide tallies

    return Counter(counters["graph_break"]), int(counters["stats"]["unique_graphs"])


@dataclass
class CompiledBlocks:
    """What `compile_blocks` did: the compiled blocks' global indices and, after the first
    forward, the graphs dynamo made and the graph breaks (reason -> count) during it."""

    indices: list[int]
    graphs: int | None = None
    graph_breaks: dict[str, int] | None = None
    announce: bool = True  # log the report (one rank does)
    _before: tuple[Counter, int] = field(default_factory=lambda: (Counter(), 0), repr=False)

    def _report(self, model: nn.Module, args: Any, output: Any) -> None:
        breaks, graphs = _counters()
        self.graph_breaks = dict(breaks - self._before[0])
        self.graphs = graphs - self._before[1]
        self._hook.remove()
        what = f"torch.compile: {len(self.indices)} decoder blocks, {self.graphs} graph(s)"
        if not self.announce:
            return
        if self.graph_breaks:
            listed = "; ".join(f"{n}x {reason}" for reason, n in self.graph_breaks.items())
            warnings.warn(f"{what}, graph breaks: {listed}", stacklevel=2)
        else:
            log.info(f"{what}, no graph break")


def compile_blocks(module: nn.Module, announce: bool = True, **options: Any) -> CompiledBlocks:
    """Compile each decoder block of `module` in place (`options`: `torch.compile`'s, e.g.
    ``mode="max-autotune"``); returns the record that the first forward completes. `announce`:
    log it (the strategies pass True on global rank 0 only)."""
    model, blocks = decoder_blocks(module)
    for _, block in blocks:
        block.compile(**options)
    record = CompiledBlocks([i for i, _ in blocks], announce=announce, _before=_counters())
    record._hook = model.register_forward_hook(record._report)  # the model itself stays eager
    return record
