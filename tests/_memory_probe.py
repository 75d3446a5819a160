"""Measuring what a training step holds in memory, per rank, on any device (CPU included).

`SavedActivations` is a pair of `saved_tensors_hooks`: every tensor autograd saves for backward
is looked at once, its storage remembered (weakly) with its size, and the bytes of the distinct
storages still alive are summed at every save; the peak of that sum over the step is the
"activations held for backward" that the planner predicts. Storages of parameters are left out
(they are the parameters' part), and so are storages that have become a parameter's gradient (the
gradients' part): a function that computes its weight's gradient in forward and saves it (the
fused head + loss, `models/fused_loss.py`) hands that tensor to autograd, which keeps it as the
parameter's `.grad` when none is there yet (the first micro-batch without dp's buckets). A storage counts once however many views of it are saved.
Selective recompute keeps its saved matmul outputs in its own cache, out of the hooks' sight, so
`SelectiveCache` adds them (the recompute policy is told each op's output).

`SentTensors` records the tensors a pipeline stage sends: they stay alive until their batch is
complete (`StageP2P`), so they are a buffer the schedule holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class LiveStorages:
    """Distinct storages, held weakly, and the peak of their summed bytes while alive."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        self.live = {p: (ref, n) for p, (ref, n) in self.live.items() if not ref.expired()}
        if ptr not in self.exclude and ptr not in self.live and storage.nbytes() > 0:
            self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.current())

    def current(self) -> int:
        return sum(n for ref, n in self.live.values() if not ref.expired())


class SavedActivations(LiveStorages):
    """`with SavedActivations(model.parameters()) as saved:` ... `saved.peak` (bytes)."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self.leave_out(parameters)
        super().__init__(self.parameters)

    def leave_out(self, parameters: Iterable[torch.Tensor]) -> None:
        """The parameters whose storages, and whose gradients' storages, are not activations."""
        self.parameters = list(parameters)
        self.exclude = {p.untyped_storage().data_ptr() for p in self.parameters}

    def current(self) -> int:
        grads = {p.grad.untyped_storage().data_ptr() for p in self.parameters if p.grad is not None}
        return sum(n for ptr, (ref, n) in self.live.items() if ptr not in grads and not ref.expired())

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t


class SelectiveCache:
    """Adds the outputs `selective` recompute keeps (its policy is wrapped to see them) to `into`,
    the `SavedActivations` of the same step: they are saved activations the hooks cannot see."""

    def __init__(self, into: LiveStorages) -> None:
        self.into = into

    def __enter__(self) -> SelectiveCache:
        from torch.utils.checkpoint import CheckpointPolicy

        from nanolight.parallel import blocks as recompute

        self._module, self._policy = recompute, recompute._keep

        def keep(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            policy = self._policy(ctx, op, *args, **kwargs)
            if policy == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
                outputs = ctx.op_output if isinstance(ctx.op_output, tuple) else (ctx.op_output,)
                for t in outputs:
                    self.into.add(t)
            return policy

        recompute._keep = keep
        return self

    def __exit__(self, *exc: Any) -> None:
        self._module._keep = self._policy


class SentTensors(LiveStorages):
    """Tensors handed to the pipeline's sends, alive until the sends complete."""

    def __enter__(self) -> SentTensors:
        from nanolight.parallel.pipeline import p2p

        self._cls, self._exchange = p2p.StageP2P, p2p.StageP2P.exchange
        probe, original = self, self._exchange

        def exchange(stage: Any, sends: list, recvs: list) -> None:
            for _, _, t in sends:
                if t is not None:
                    probe.add(t)
            original(stage, sends, recvs)

        p2p.StageP2P.exchange = exchange
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cls.exchange = self._exchange
