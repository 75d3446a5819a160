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
`build_buckets`; copied only for a group of several dtypes), so a single process steps the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb

# torch >= 2.11 renamed the "_tensor" flat collectives to "_single"; support both
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- the buckets' flat-buffer layout (shared with `ZeroOptimizer`) ------------------------------
#
# The flat-buffer layout of gradient buckets, shared by `GradReducer` and `ZeroOptimizer`.
#
# Pure bookkeeping, no communication: which parameters share a bucket, where each one sits in
# the bucket's flat buffer, how the bucket is padded to split into dp equal slices, and where this
# rank's slice of each bucket lands in its param group's flat ZeRO-1 shard.
#
# At dp=1 a param group's buckets are consecutive slices of one buffer, the group's flat gradient
# (`Bucket.group_buffer`): ZeRO-1's one shard is then that buffer itself, not a copy of it (4 B/param
# less under ``bf16-master`` on one GPU).


@dataclass
class Bucket:
    """Consecutive parameters of one param group and dtype sharing one flat gradient buffer of
    `numel` elements, a multiple of dp (zero padding at the end) so that it splits into dp equal
    slices; this rank's slice lands at `shard_offset` of its group's flat shard (ZeRO-1)."""

    index: int
    group_index: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    buffer: Tensor
    shard_offset: int
    deferred: bool = False  # holds parameters summed over another group first: reduced in finish()
    launched: bool = False
    views: list[Tensor] = field(default_factory=list)
    fired: set[int] = field(default_factory=set)  # params whose gradient is final this step
    # dp=1, one dtype: the group's one buffer, `buffer` being its slice at `shard_offset`
    group_buffer: Tensor | None = None

    @property
    def pending(self) -> int:
        return len(self.params) - len(self.fired)


def _make_bucket(
    index: int,
    group_index: int,
    params: list[nn.Parameter],
    shard_offset: int,
    dp: int,
    deferred: bool,
    dtype: torch.dtype | None,
    within: Tensor | None = None,
) -> Bucket:
    """`within`: the group's flat buffer, this bucket's being its slice at `shard_offset` (dp=1)."""
    offsets, n = [], 0
    for p in params:
        offsets.append(n)
        n += p.numel()
    padded = -(-n // dp) * dp  # a multiple of dp: dp equal slices
    if within is not None:
        buffer = within[shard_offset : shard_offset + padded]
    else:
        buffer = torch.zeros(padded, dtype=dtype or params[0].dtype, device=params[0].device)
    views = [buffer[o : o + p.numel()].view_as(p) for o, p in zip(offsets, params, strict=True)]
    bucket = Bucket(index, group_index, params, offsets, padded, buffer, shard_offset, deferred, views=views)
    bucket.group_buffer = within
    return bucket


def _chunks(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    chunks: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not chunks or size + nbytes > bucket_bytes or p.dtype != chunks[-1][0].dtype:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += nbytes
    return chunks


def build_buckets(
    param_groups: Sequence[Sequence[nn.Parameter]],
    bucket_bytes: int,
    dp: int,
    deferred: set[int] = frozenset(),
    dtype: torch.dtype | None = None,
) -> tuple[list[Bucket], list[int]]:
    """Lay every group's parameters out in buckets; returns (buckets, shard numel per group).

    A parameter is never split: one larger than `bucket_bytes` gets a bucket of its own.
    Buckets never mix param groups (ZeRO keeps one flat shard per group, so that weight decay
    and LR stay per group) nor dtypes. Parameters in `deferred` (ids) go to trailing buckets of
    their group, reduced only in `GradReducer.finish`. `dtype`: the buffers' dtype (None: the
    parameters'; fp32 under ``bf16-master``, whose gradients accumulate apart from ``.grad``).
    At dp=1 a group of one buffer dtype gets one buffer, its buckets' being slices of it
    (`Bucket.group_buffer`).
    """
    buckets: list[Bucket] = []
    shard_sizes = []
    for g, params in enumerate(param_groups):
        order = list(reversed(list(params)))  # backward produces the last layers' grads first
        within = _group_buffer(order, dtype) if dp == 1 else None
        shard_offset = 0
        for is_deferred in (False, True):
            for chunk in _chunks([p for p in order if (id(p) in deferred) == is_deferred], bucket_bytes):
                buckets.append(
                    _make_bucket(len(buckets), g, chunk, shard_offset, dp, is_deferred, dtype, within)
                )
                shard_offset += buckets[-1].numel // dp
        shard_sizes.append(shard_offset)
    return buckets, shard_sizes


def _group_buffer(params: list[nn.Parameter], dtype: torch.dtype | None) -> Tensor | None:
    """One zeroed buffer for all of a group's gradients (dp=1: no padding), or None when they
    are of several dtypes (each bucket then has its own)."""
    dtypes = {dtype} if dtype is not None else {p.dtype for p in params}
    if not params or len(dtypes) != 1:
        return None
    return torch.zeros(sum(p.numel() for p in params), dtype=dtypes.pop(), device=params[0].device)


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
        elif p.grad is not view:  # autograd made a new tensor (identity: a fake tensor has no data pointer)
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
