"""`GradReducer`: bucketed dp gradient reduction from backward hooks.

Checks: the reduced gradients are the dp mean of every rank's accumulated gradients (all-reduce
mode) or this rank's slice of it (reduce-scatter mode, ZeRO-1); no collective runs during the
backward of micro-batches before the last one; the buckets have the configured size and are
launched, in order, while backward is still running (overlap)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _tiny import run_distributed, tiny_config

from nanolight.models import LlamaForCausalLM
from nanolight.parallel import data_parallel
from nanolight.parallel.data_parallel import GradReducer, build_buckets

MICRO, B, T, BUCKET = 3, 2, 16, 16 * 1024


def tiny_model() -> LlamaForCausalLM:
    cfg = tiny_config()
    model = LlamaForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def micro_batches(rank: int) -> torch.Tensor:
    return torch.randint(0, 128, (MICRO, B, T), generator=torch.Generator().manual_seed(10 + rank))


class CountCollectives:
    """Counts the dp collectives the reducer issues (monkeypatched into this worker process)."""

    def __init__(self) -> None:
        self.calls = 0
        orig_ar, orig_rs = dist.all_reduce, data_parallel.reduce_scatter_single

        def all_reduce(*args, **kwargs):
            self.calls += 1
            return orig_ar(*args, **kwargs)

        def reduce_scatter(*args, **kwargs):
            self.calls += 1
            return orig_rs(*args, **kwargs)

        dist.all_reduce = all_reduce
        data_parallel.reduce_scatter_single = reduce_scatter


def _reducer_worker(rank: int, world: int, shard: bool) -> dict:
    model = tiny_model()
    ref = copy.deepcopy(model)
    embed = model.model.embed_tokens.weight  # its gradient is the last one backward produces
    seen_at_embed: list[int] = []
    embed.register_post_accumulate_grad_hook(lambda p: seen_at_embed.append(len(reducer.launch_log)))
    params = list(model.parameters())
    reducer = GradReducer([params], dist.group.WORLD, bucket_bytes=BUCKET, shard=shard)
    counter = CountCollectives()

    reducer.zero_grad()
    calls_per_backward = []
    for i, x in enumerate(micro_batches(rank)):
        reducer.require_sync(i == MICRO - 1)  # reduce only in the last micro-batch's backward
        (model(x, labels=x) / MICRO).backward()
        calls_per_backward.append(counter.calls)
    reducer.finish()

    # the expected gradient: the mean over dp ranks of each rank's accumulated gradient
    expected = {id(p): torch.zeros_like(p) for p in ref.parameters()}
    for r in range(world):
        ref.zero_grad()
        for x in micro_batches(r):
            (ref(x, labels=x) / MICRO).backward()
        for p in ref.parameters():
            expected[id(p)] += p.grad / world
    ref_by_model = {id(p): expected[id(q)] for p, q in zip(params, ref.parameters(), strict=True)}
    for bucket in reducer.buckets:
        full = torch.cat([ref_by_model[id(p)].reshape(-1) for p in bucket.params])
        full = torch.cat([full, full.new_zeros(bucket.numel - full.numel())])
        if shard:
            got, want = reducer.shard_view(bucket), full.chunk(world)[rank]
        else:
            got, want = bucket.buffer, full
            for p, view in zip(bucket.params, bucket.views, strict=True):
                assert p.grad.data_ptr() == view.data_ptr()  # .grad is the bucket view
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    return {
        "calls": calls_per_backward,
        "buckets": len(reducer.buckets),
        "launch_log": reducer.launch_log,
        "seen_at_embed": seen_at_embed,
        "bucket_bytes": [sum(p.numel() * p.element_size() for p in b.params) for b in reducer.buckets],
        "bucket_params": [len(b.params) for b in reducer.buckets],
    }


@pytest.mark.parametrize("shard", [False, True], ids=["all-reduce", "reduce-scatter"])
def test_bucketed_reduction(shard: bool) -> None:
    out = run_distributed(_reducer_worker, 2, shard, timeout=120)
    for o in out:
        n = o["buckets"]
        assert n >= 3
        assert o["calls"][:-1] == [0] * (MICRO - 1)  # nothing sent before the last micro-batch
        assert o["calls"][-1] == n  # then one collective per bucket, all launched from hooks
        assert o["launch_log"] == list(range(n))  # in bucket order, the same on every rank
        assert 1 <= o["seen_at_embed"][-1] < n  # buckets were in flight before backward ended
        for nbytes, count in zip(o["bucket_bytes"], o["bucket_params"], strict=True):
            assert nbytes <= BUCKET or count == 1  # a bigger parameter gets a bucket of its own


def test_bucket_layout_pads_to_dp_and_keeps_groups_apart() -> None:
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (5, 7, 300))
    buckets, shard_sizes = build_buckets([[a, b], [c]], bucket_bytes=64, dp=4, deferred={id(b)})
    assert [[p.numel() for p in bk.params] for bk in buckets] == [[5], [7], [300]]
    assert [bk.numel for bk in buckets] == [8, 8, 300]  # padded to multiples of dp
    assert [bk.deferred for bk in buckets] == [False, True, False]
    assert shard_sizes == [4, 75] and [bk.shard_offset for bk in buckets] == [0, 2, 0]


def _bf16_mixed_worker(rank: int, world: int) -> bool:
    model = tiny_model()
    reducer = GradReducer([list(model.parameters())], dist.group.WORLD, bucket_bytes=BUCKET)
    x = micro_batches(rank)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16-mixed: fp32 params, bf16 compute
        loss = model(x, labels=x)
    loss.backward()
    reducer.finish()
    for bucket in reducer.buckets:  # gradients, their accumulation and reduction stay fp32
        assert bucket.buffer.dtype == torch.float32
        assert all(
            p.grad.dtype == torch.float32 and p.grad.data_ptr() == v.data_ptr()
            for p, v in zip(bucket.params, bucket.views, strict=True)
        )
    return True


def test_bf16_mixed_reduces_fp32_gradients() -> None:
    assert run_distributed(_bf16_mixed_worker, 2, timeout=120) == [True, True]
