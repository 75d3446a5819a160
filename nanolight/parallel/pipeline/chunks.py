"""`StageChunks`: run one of a rank's v chunks (virtual stages) through the model's own forward.

After `apply_split` the model holds all of this rank's layers (v non-adjacent runs under
interleaving), and its forward runs every layer it holds, then its head if it has one. A chunk
forward must run only that chunk's run of layers, and the head only in the model's last chunk.
`only(c)` makes the model look like chunk c for the duration of one forward -- the blocks module
swapped for the chunk's (the same layer objects), the "last" modules hidden outside the last
chunk -- and puts everything back afterwards, through the public `set_submodule` / attribute
API. Nothing is copied; parameter names and ``state_dict`` keys are the model's own whenever
no chunk forward is running, and autograd keeps what each forward needs for its backward.
The "first" modules need no hiding: a chunk after the first is given ``hidden_states``, which
the model's forward takes in place of its embedding's output.

With one chunk per rank (v = 1) nothing is swapped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from nanolight.parallel.pipeline.split import PipelineSplit, StageLayers


class StageChunks:
    """Rank `stage`'s chunks of `model` (already cut by `apply_split` with `split`)."""

    def __init__(self, model: nn.Module, split: PipelineSplit, stage: int) -> None:
        self.model, self.split = model, split
        self._forward = type(model).forward.__get__(model)  # the model's own, stage-skipping forward
        self.pp_rank, self.pp_size = stage, split.pp_size
        self.virtual_stages = split.chunks(stage)  # global chunk index of each local chunk
        self.num_chunks = len(split.ranges)
        held = model.get_submodule(split.layers)
        self._all = held
        self._runs = [
            StageLayers({str(i): held[str(i)] for i in split.ranges[g]}) for g in self.virtual_stages
        ]
        last = [(name, model.get_submodule(name)) for name in split.last if split.keeps(stage, name)]
        self._last = last  # the head etc., present on the last rank only

    def is_first(self, chunk: int) -> bool:
        """Local chunk `chunk` is virtual stage 0 (it takes the token ids, no activation)."""
        return self.virtual_stages[chunk] == 0

    def is_last(self, chunk: int) -> bool:
        """Local chunk `chunk` is the model's last virtual stage (it returns the loss or logits)."""
        return self.virtual_stages[chunk] == self.num_chunks - 1

    def forward(self, chunk: int, input_ids: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        """Local chunk `chunk`'s forward: the model's own, on the chunk's layers."""
        with self.only(chunk):
            return self._forward(input_ids, *args, **kwargs)

    @contextmanager
    def only(self, chunk: int) -> Iterator[None]:
        """The model runs local chunk `chunk` alone while inside."""
        if len(self._runs) == 1:
            yield
            return
        hidden = [] if self.is_last(chunk) else self._last
        self.model.set_submodule(self.split.layers, self._runs[chunk])
        for name, _ in hidden:
            _set(self.model, name, None)
        try:
            yield
        finally:
            self.model.set_submodule(self.split.layers, self._all)
            for name, module in hidden:
                _set(self.model, name, module)


def _set(model: nn.Module, name: str, module: nn.Module | None) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
