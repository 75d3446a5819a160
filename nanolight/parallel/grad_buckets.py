"""The flat-buffer layout of gradient buckets, shared by `GradReducer` and `ZeroOptimizer`.

Pure bookkeeping, no communication: which parameters share a bucket, where each one sits in
the bucket's flat buffer, how the bucket is padded to split into dp equal slices, and where this
rank's slice of each bucket lands in its param group's flat ZeRO-1 shard.

At dp=1 a param group's buckets are consecutive slices of one buffer, the group's flat gradient
(`Bucket.group_buffer`): ZeRO-1's one shard is then that buffer itself, not a copy of it (4 B/param
less under ``bf16-master`` on one GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


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
