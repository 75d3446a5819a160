"""The NCCL emulation's order checker on recordings written by hand: each case NCCL hangs on is
reported with the stuck ops named, and each safe neighbour of it is not (`_nccl_emulation`)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from _nccl_emulation import Msg, Op, assert_nccl_safe, deadlocks, nccl_problems, recorded_worlds

SHAPE = (2, 3)
PAIR = (0, 1)


class Log:
    """One rank's recording, built call by call; each call returns its op's seq (for `wait`)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.ops = rank, []

    def _add(self, kind: str, **fields: object) -> int:
        self.ops.append(Op(self.rank, len(self.ops), kind, **fields))
        return len(self.ops) - 1

    def batch(self, *msgs: tuple[str, int], group: str = "g", shape: tuple[int, ...] = SHAPE) -> int:
        ms = tuple(Msg(kind == "send", peer, shape, "torch.float32") for kind, peer in msgs)
        return self._add("batch", group=group, group_ranks=PAIR, msgs=ms)

    def collective(self, group: str, name: str = "all_reduce", shape: tuple[int, ...] = (4,)) -> int:
        return self._add(
            "collective", group=group, group_ranks=PAIR, name=name, shape=shape, dtype="torch.float32"
        )

    def wait(self, seq: int) -> None:
        self._add("wait", target=seq)


def test_a_crossed_pair_of_batches_deadlocks_and_one_exchange_does_not() -> None:
    rank0, rank1 = Log(0), Log(1)
    rank0.batch(("send", 1)), rank0.batch(("recv", 1))
    rank1.batch(("send", 0)), rank1.batch(("recv", 0))
    found = deadlocks([rank0.ops, rank1.ops])
    assert len(found) == 2, found
    assert (
        "deadlock: rank 0 on group g: batch[send→1 (2, 3)] (op 0) started, waits for rank 1's op 1"
        in found[0]
    )
    assert "rank 1 on group g: batch[send→0 (2, 3)] (op 0)" in found[1]

    rank0, rank1 = Log(0), Log(1)
    rank0.batch(("send", 1), ("recv", 1))
    rank1.batch(("send", 0), ("recv", 0))
    assert nccl_problems([rank0.ops, rank1.ops]) == []


def test_a_receive_batched_with_a_later_message_deadlocks() -> None:
    """Rank 1 receives micro-batches 0 and 1 in one batch, then sends a gradient; rank 0 sends
    micro-batch 0, receives the gradient and only then (after waiting for it) sends micro-batch 1:
    the gradient's send is queued behind the batch that waits for micro-batch 1."""
    rank0, rank1 = Log(0), Log(1)
    rank0.batch(("send", 1))
    grad = rank0.batch(("recv", 1))
    rank0.wait(grad)
    rank0.batch(("send", 1))
    rank1.batch(("recv", 0), ("recv", 0))
    rank1.batch(("send", 0))
    found = deadlocks([rank0.ops, rank1.ops])
    assert any(
        "rank 0 on group g: batch[recv←1 (2, 3)] (op 1) started, waits for rank 1's op 1" in f for f in found
    )
    assert any("rank 1 on group g: batch[recv←0 (2, 3), recv←0 (2, 3)] (op 0) started, waits for rank 0's op 3" in f
               for f in found), found  # fmt: skip

    rank1 = Log(1)  # one receive per batch: the gradient goes out after micro-batch 0
    rank1.batch(("recv", 0)), rank1.batch(("send", 0)), rank1.batch(("recv", 0))
    assert nccl_problems([rank0.ops, rank1.ops]) == []


def test_a_wait_makes_a_dependency_across_two_groups() -> None:
    def run(rank1_waits: bool) -> list[str]:
        rank0, rank1 = Log(0), Log(1)
        grad = rank0.batch(("recv", 1), group="bwd")
        rank0.wait(grad)
        rank0.batch(("send", 1), group="fwd")
        act = rank1.batch(("recv", 0), group="fwd")
        if rank1_waits:
            rank1.wait(act)
        rank1.batch(("send", 0), group="bwd")
        return deadlocks([rank0.ops, rank1.ops])

    found = run(rank1_waits=True)
    assert any("rank 0 on group fwd: batch[send→1 (2, 3)] (op 2) never starts: issued after a wait (op 1)" in f
               for f in found), found  # fmt: skip
    assert any("rank 1 on group bwd: batch[send→0 (2, 3)] (op 2) never starts" in f for f in found), found
    assert run(rank1_waits=False) == []


def test_collectives_in_different_orders_on_two_groups_deadlock() -> None:
    rank0, rank1 = Log(0), Log(1)
    for log, groups in ((rank0, ("g1", "g2")), (rank1, ("g2", "g1"))):
        for g in groups:
            log.wait(log.collective(g))  # blocking: async_op=False
    found = deadlocks([rank0.ops, rank1.ops])
    assert any("rank 0 on group g1: all_reduce (4,) torch.float32 (op 0) started, waits for rank 1's op 2" in f
               for f in found), found  # fmt: skip
    assert any("rank 0 on group g2: all_reduce (4,) torch.float32 (op 2) never starts" in f for f in found), (
        found
    )

    rank1 = Log(1)
    for g in ("g1", "g2"):
        rank1.wait(rank1.collective(g))
    assert nccl_problems([rank0.ops, rank1.ops]) == []


def test_a_collective_mismatch_is_reported() -> None:
    rank0, rank1 = Log(0), Log(1)
    rank0.collective("g", shape=(4,)), rank0.collective("g", "broadcast")
    rank1.collective("g", shape=(3,)), rank1.collective("g", "all_reduce")
    found = nccl_problems([rank0.ops, rank1.ops])
    assert "group g: collective 0 differs: rank 0 issues on group g: all_reduce (4,) torch.float32, rank 1 " \
        "on group g: all_reduce (3,) torch.float32" in found, found  # fmt: skip
    assert any("collective 1 differs" in f and "broadcast" in f for f in found), found


def test_a_collective_one_rank_never_issues_is_stuck() -> None:
    rank0, rank1 = Log(0), Log(1)
    rank0.collective("g")
    found = deadlocks([rank0.ops, rank1.ops])
    assert found == [
        "deadlock: rank 0 on group g: all_reduce (4,) torch.float32 (op 0) started, waits for a matching op "
        "that is never issued to start"
    ], found


def test_only_worlds_all_of_whose_ranks_wrote_are_checked(tmp_path: Path) -> None:
    """What `conftest.py` reads after a test: a world with a rank that never wrote (killed) is skipped."""
    rank0, rank1 = Log(0), Log(1)
    rank0.batch(("send", 1)), rank0.batch(("recv", 1))
    rank1.batch(("send", 0)), rank1.batch(("recv", 0))
    for key, ranks in (("a", (0, 1)), ("b", (0,))):
        for r in ranks:
            data = {"key": key, "rank": r, "world_size": 2, "ops": [rank0, rank1][r].ops}
            (tmp_path / f"{key}-rank{r}.pkl").write_bytes(pickle.dumps(data))
    worlds = recorded_worlds(tmp_path)
    assert list(worlds) == ["a"]
    with pytest.raises(AssertionError, match="deadlock: rank 0 on group g"):
        assert_nccl_safe(worlds["a"])
