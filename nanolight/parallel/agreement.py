"""Agreeing on a small integer over every rank without stalling the device or the step.

Why: a question every rank must answer alike every step (pre-emption: "did a signal reach any
rank, and which?") is an all-reduce of one integer. Done on the device under NCCL, reading the
answer (``.item()``) makes the host wait for every kernel queued before it, once per step. So
the answer travels on the host: an all-reduce of a CPU tensor over a gloo group
(`ParallelContext.host_group`), started without waiting (``async_op=True``) and waited for later,
typically at the next step, by when it has long arrived. Reading a CPU tensor is no device sync;
it is read with ``.numpy()``, which a device tensor refuses, so the box cannot silently move to
the GPU and bring the sync back.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist


class Agreed:
    """An agreement already complete (one process: nothing to exchange)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def wait(self) -> int:
        return self.value


class PendingMax:
    """The maximum of each rank's `value`, all-reduced over `group` (a gloo group; None: the
    world, itself gloo), in flight until `wait`. `guard` wraps the start and the wait (e.g. a
    heartbeat watch that names a silent peer)."""

    def __init__(
        self, value: int, group: Any = None, guard: Callable[[], AbstractContextManager] = nullcontext
    ) -> None:
        self.guard = guard
        self.box = torch.tensor([value], dtype=torch.int64)  # on the host, always
        with guard():
            # every rank of `group` (the whole world) sends its integer; all receive the maximum
            self.work: Any = dist.all_reduce(self.box, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self.value: int | None = None

    def wait(self) -> int:
        """The agreed value (the same on every rank); waits only if it has not arrived yet."""
        if self.value is None:
            with self.guard():
                self.work.wait()
            self.work = None  # let go of gloo's work object (and its hold on the box) at once
            self.value = int(self.box.numpy()[0])  # a host tensor: no device sync
        return self.value
