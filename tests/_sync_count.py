"""Counting host synchronisations per optimizer step, on CPU, for `test_sync_free.py`.

Why a dispatch mode: on a GPU, ``.item()`` / ``float(t)`` / ``bool(t)`` / ``int(t)`` of a device
tensor blocks the host until the device catches up, and a step that does so every time cannot
queue the next step's kernels ahead. On CPU nothing blocks, but the same calls reach the same
aten op, ``_local_scalar_dense``, so a `TorchDispatchMode` that counts it (and the other ops that
read device values back: ``equal``, ``nonzero``, ``is_nonzero``) finds them on the CPU-only CI.
``Tensor.tolist`` and ``.cpu()`` read data without such an op (``.cpu()`` of a CPU tensor
dispatches nothing), so they are counted by wrapping the methods. ``.numpy()`` is not counted:
a device tensor refuses it (TypeError), so it only ever reads a host tensor -- which is how
host-side values (the pre-emption agreement's gloo box) are read on purpose.

`SyncCounter` attributes every counted call to the optimizer step in flight, read from the fit
loop's position when the call happens (the window of micro-batches taken, one epoch): step k
(1-based) runs from taking its batches to taking step k+1's, so it includes step k's logger
row, validation, checkpoint save and pre-emption check, whatever order the callbacks run in;
``on_train_end`` onwards is "end", before training (setup, sanity check) is step 0. The optimizer's own ``step`` is not counted (`pause_during`): torch's AdamW on CPU keeps
its ``step`` counters as CPU tensors and reads them with ``.item()``, which is no device sync
(with ``fused=True`` on CUDA, as the recipe uses, the counter lives on the device).
"""

from __future__ import annotations

import functools
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanolight import Callback

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
SYNC_PACKETS = {aten.nonzero}  # output size depends on values: a sync on CUDA
READ_BACK = ("tolist", "cpu")


class SyncCounter(TorchDispatchMode, Callback):
    """Counts host syncs per step (``counts[step]``; ``where[step]``: a short stack of each)."""

    def __init__(self) -> None:
        TorchDispatchMode.__init__(self)
        self.trainer: Any = None
        self.ended = False
        self.counts: Counter = Counter()
        self.where: dict[Any, list[str]] = defaultdict(list)
        self.paused = 0
        self._patched: dict[str, Callable] = {}

    # ---- counting ------------------------------------------------------------------------
    def _record(self, what: str) -> None:
        if self.paused:
            return
        step = self.step
        self.counts[step] += 1
        frames = [
            f for f in traceback.extract_stack()[:-3] if "nanolight" in f.filename or "tests" in f.filename
        ]
        self.where[step].append(f"{what} at " + " <- ".join(f"{f.name}:{f.lineno}" for f in frames[::-1][:4]))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SYNC_OPS or func.overloadpacket in SYNC_PACKETS:
            self._record(str(func))
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> SyncCounter:
        for name in READ_BACK:
            original = self._patched[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._reading(name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        self._patched.clear()

    def _reading(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._record(f"Tensor.{name}")
            self.paused += 1  # .tolist() may dispatch its own reads: one count per call
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self.paused -= 1

        return read

    def pause_during(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def paused(*args: Any, **kwargs: Any) -> Any:
            self.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused -= 1

        return paused

    # ---- attribution (callback hooks) ----------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.trainer = trainer
        for opt in trainer.optimizers:  # the torch optimizer itself (inside a ZeRO wrapper too)
            inner = getattr(opt, "optimizer", opt)
            inner.step = self.pause_during(inner.step)

    @property
    def step(self) -> int | str:
        """The optimizer step in flight (1-based; 0 before training), or "end"."""
        trainer = self.trainer
        if self.ended:
            return "end"
        if trainer is None:
            return 0
        if trainer.current_epoch:
            return "later epoch"  # the test's data is one epoch long: not expected
        taken = trainer.progress["batch_idx"]  # batches of this epoch taken so far
        return -(-taken // trainer.accumulate_grad_batches)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.trainer, self.ended = trainer, False

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.ended = True

    def report(self, steps: list[int]) -> str:
        return "\n".join(f"step {s}: {self.counts[s]} syncs\n  " + "\n  ".join(self.where[s]) for s in steps)
