"""Data parallelism: average gradients over the dp group, in buckets, overlapped with backward.

Why buckets: one collective per parameter pays the latency of hundreds of tiny messages; one
for the whole model can only start once backward has finished. A bucket (a few MB of
consecutive parameters in reverse registration order, roughly the order backward produces
their gradients) is sent as soon as its last gradient is final, so the last layers' collective
runs while autograd still computes the first layers.

`GradReducer`: every ``param.grad`` is a *view* into its bucket's flat buffer, so micro-batches
accumulate straight into it and the collective needs no copy (a ``.grad`` that is not the view
is copied in and re-pointed by the hook). A post-accumulate-grad hook counts each bucket down
during the backward of the *last* micro-batch of the step (``require_sync(True)``; earlier
micro-batches only accumulate: no communication) and launches full buckets asynchronously, in
index order on every rank so that collectives match across the group. `finish` launches the
rest and waits: ``shard=False`` all-reduces each bucket in place (``param.grad`` = dp mean);
``shard=True`` (ZeRO-1) reduce-scatters it into ``shard_grads`` (this rank's 1/dp slice of the
dp mean) and ``param.grad`` keeps the local, unreduced gradient.

Precision: by default gradients have the parameter's dtype. ``bf16-mixed`` keeps fp32 parameters
(autocast only computes in bf16), so accumulation and reduction are fp32. Under ``bf16-true``
parameters, ``.grad``, the accumulation and the reduction are bf16 (as in Lightning); ZeRO-1 then
still steps fp32 master weights. With ``grad_dtype`` (``bf16-master``: fp32 for bf16 weights) the
buckets are *main gradients* apart from ``.grad`` (Megatron's ``main_grad``): the hook adds each
micro-batch's bf16 ``.grad`` into the fp32 bucket and drops it, so the sum over micro-batches and
the dp reduction are fp32; ``grad_view(p)`` is where p's gradient is.

One rank (``group`` None, or a group of one): no collective; `finish` leaves the buckets as they
are (``shard=True``: ``shard_grads`` are the buckets themselves, one flat buffer per param group,
`grad_buckets.py`; copied only for a group of several dtypes), so a single process steps the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from nanolight.parallel.grad_buckets import Bucket, build_buckets

DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb

# torch >= 2.11 renamed the "_tensor" flat collectives to "_single"; support both
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class GradReducer:
    """Bucketed, backward-overlapped gradient averaging over `group` (see the module docstring)."""

    def __init__(
        self,
        param_groups: Sequence[Sequence[nn.Parameter]],
        group: Any,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        shard: bool = False,
        deferred: Collection[int] = (),
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        """`deferred`: ids of parameters whose gradients are partial sums that another group
        completes first (`parallel/grads.py`: the norm weights over tp under sequence parallelism,
        the tied embedding's two stage copies). Their buckets wait for `finish` (a blocking
        collective in a backward hook could deadlock a pipeline)."""
        self.group = group
        self.dp_size, self.dp_rank = (
            (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
        )
        self.shard = shard
        self.main_grads = grad_dtype is not None  # buckets apart from .grad (see the module docstring)
        deferred = set(deferred)
        self.buckets, self.shard_sizes = build_buckets(
            param_groups, bucket_bytes, self.dp_size, deferred, grad_dtype
        )
        self.shard_grads: list[Tensor] = []
        if shard:  # this rank's slice of every bucket, concatenated per param group
            for g, size in enumerate(self.shard_sizes):
                first = next((b for b in self.buckets if b.group_index == g), None)
                if first is not None and first.group_buffer is not None:
                    self.shard_grads.append(first.group_buffer)  # dp=1: the buckets are the shard
                    continue
                like = first.buffer if first is not None else torch.zeros(0)
                self.shard_grads.append(torch.zeros(size, dtype=like.dtype, device=like.device))
        self._shard_is_buckets = [any(b.group_buffer is s for b in self.buckets) for s in self.shard_grads]
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._order = [b for b in self.buckets if not b.deferred]  # launched from hooks, in this order
        self._sync = True
        self._next = 0  # position in `_order` of the next bucket to launch (same on every rank)
        self._works: list[Any] = []
        self.ready = False  # True between `finish` and the next `zero_grad` / optimizer step
        self.launch_log: list[int] = []  # bucket indices in launch order (tests, debugging)
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for b in self.buckets for p in b.params
        ]
        self.zero_grad()

    def shard_view(self, bucket: Bucket) -> Tensor:
        """Where the reduce-scatter writes this rank's slice of `bucket` (ZeRO-1)."""
        n = bucket.numel // self.dp_size
        return self.shard_grads[bucket.group_index][bucket.shard_offset : bucket.shard_offset + n]

    def require_sync(self, enabled: bool) -> None:
        """Call before each backward: True on the last micro-batch of the step only (DDP's
        ``no_sync()`` for the others: they only accumulate)."""
        self._sync = enabled

    def grad_view(self, param: nn.Parameter) -> Tensor:
        """Where `param`'s gradient accumulates and is reduced (its ``.grad`` unless main gradients)."""
        bucket, i = self._where[id(param)]
        return bucket.views[i]

    def _bind(self, bucket: Bucket, i: int) -> None:
        """Make ``param.grad`` the bucket view again, keeping its value (None counts as zero); with
        main gradients add ``.grad`` into the bucket (fp32) and drop it."""
        p, view = bucket.params[i], bucket.views[i]
        if self.main_grads:
            if p.grad is not None:
                view.add_(p.grad)
                p.grad = None
            return
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        else:
            return
        p.grad = view

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket, i = self._where[id(param)]
        self._bind(bucket, i)
        if self._sync and self.dp_size > 1:  # one rank: nothing to overlap, `finish` does it
            bucket.fired.add(i)
            if not bucket.deferred and bucket.pending == 0:
                self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._order) and self._order[self._next].pending == 0:
            self._launch(self._order[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        self.launch_log.append(bucket.index)
        if self.dp_size == 1:  # no peer: the local gradient is the mean
            if self.shard and bucket.group_buffer is None:  # a group of several dtypes: a copy
                self.shard_view(bucket).copy_(bucket.buffer)
            return
        if self.shard:
            # dp ranks reduce-scatter the bucket: each receives the sum of its 1/dp slice
            work = reduce_scatter_single(
                self.shard_view(bucket), bucket.buffer, group=self.group, async_op=True
            )
        else:
            bucket.buffer.div_(self.dp_size)  # pre-divide: the sum of dp means is the mean
            # dp ranks all-reduce the bucket in place: every rank gets the sum of the means
            work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        self._works.append(work)

    def finish(self, before_deferred: Callable[[], None] = lambda: None) -> None:
        """End of backward: launch the buckets not launched yet, wait for all, leave the dp mean.
        `before_deferred` completes the deferred gradients first (see `__init__`)."""
        for bucket in self.buckets:
            if not bucket.launched:  # deferred buckets, and parameters without a gradient this step
                for i in range(len(bucket.params)):
                    self._bind(bucket, i)
                    bucket.fired.add(i)
        self._launch_ready()
        before_deferred()
        for bucket in self.buckets:
            if bucket.deferred:
                self._launch(bucket)
        for work in self._works:
            work.wait()
        self._works = []
        if self.shard and self.dp_size > 1:
            for shard in self.shard_grads:
                shard.div_(self.dp_size)
        self._reset()
        self.ready = True

    def _reset(self) -> None:
        self._next = 0
        for bucket in self.buckets:
            bucket.fired, bucket.launched = set(), False

    def zero_grad(self) -> None:
        """Zero the buffers and point every ``.grad`` at its view (cheaper than set_to_none:
        the next backward accumulates in place instead of allocating and copying)."""
        for work in self._works:  # e.g. a skipped step: never zero under an in-flight collective
            work.wait()
        self._works = []
        for bucket in self.buckets:
            bucket.buffer.zero_()
            for p, view in zip(bucket.params, bucket.views, strict=True):
                p.grad = None if self.main_grads else view
        for shard, bucket_views in zip(self.shard_grads, self._shard_is_buckets, strict=True):
            if not bucket_views:  # (dp=1: the buckets themselves, zeroed above)
                shard.zero_()
        self._reset()
        self.ready = False

    def remove(self) -> None:
        """Unregister the hooks (the buffers stay referenced by ``.grad`` until zero_grad(None))."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
