"""Host-side agreements (pre-emption flags, broadcasts) at a per-rank cost that does not grow with
the world: no gloo group over the whole world, a constant number of store messages per rank per
agreement, and nothing left behind in the store."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from nanolight.parallel import ParallelContext


class Counting:
    """The agreements' store, with every call counted."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return method(*args, **kwargs)

        return counted


def _agree(rank: int, world: int) -> dict[str, Any]:
    ctx = ParallelContext(dp=world)
    store = Counting(ctx.agreements.store)
    ctx.agreements.store = store
    values = [rank % 3, 0, world - 1 if rank == 1 else 0]
    pending = [ctx.start_max(v) for v in values]  # three in flight at once, read in order
    agreed = [p.wait() for p in pending]
    obj = ctx.broadcast_object({"seed": 1234, "rank": rank} if rank == 1 else None, src=1)
    calls = store.calls
    dist.barrier()  # every rank done: the rounds' keys are gone
    rounds = range(1, ctx.agreements.round + 1)
    left = [k for r in rounds for k in (f"{r}/max", f"{r}/count", f"{r}/done", f"{r}/read", f"{r}/obj")
            if store.store.check([k])]  # fmt: skip
    return {"agreed": agreed, "obj": obj, "calls_per_agreement": calls / 4, "left": left}


@pytest.mark.parametrize("world", [2, 4])
def test_store_agreements_are_exact_and_cheap(world: int) -> None:
    out = run_distributed(_agree, world)
    want = [min(2, world - 1), 0, world - 1]  # max of rank % 3; all zeros; rank 1's world - 1
    for rank in out:
        assert rank["agreed"] == want
        assert rank["obj"] == {"seed": 1234, "rank": 1}
        assert rank["left"] == []
        # 4 messages, up to 2 more to raise the maximum, 5 more for the rank that arrives or
        # reads last (the `done` flag, the deletes): a bound that does not depend on the world
        assert rank["calls_per_agreement"] <= 11, rank


def _groups(rank: int, world: int) -> list[Any]:
    """ParallelContext under NCCL (faked: the groups are gloo's, the backend's name says nccl)."""
    made = []
    real = dist.new_group

    def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
        made.append(sorted(ranks) if ranks is not None else list(range(world)))
        kwargs.pop("backend", None)
        return real(ranks=ranks, **kwargs)

    dist.new_group = new_group
    dist.get_backend = lambda group=None: "nccl"
    torch.cuda.current_device = lambda: 0
    ctx = ParallelContext(tp=2, dp=world // 2)
    assert ctx.start_max(rank).wait() == world - 1
    return made


def test_no_gloo_group_over_the_whole_world_under_nccl() -> None:
    for made in run_distributed(_groups, 4):
        assert made and all(len(ranks) < 4 for ranks in made), made  # tp pairs, dp pairs, pp singles
