"""The per-step host agreement (`parallel/agreement.py`) against the plain maximum, with many ranks
as threads sharing one real `TCPStore` server: every rank gets the maximum, and each rank's
requests per agreement do not grow with the number of ranks (the gloo all-reduce it replaces sent
2(N-1) messages per rank)."""

from __future__ import annotations

import random
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from nanolight.parallel.agreement import StoreAgreements

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_counts import CountingClient  # noqa: E402  (the benchmark's counting store client)


def _agree(world: int, rounds: list[list[int]]) -> tuple[list[list[int]], list[CountingClient]]:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    clients = [
        CountingClient(dist.TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=30)))
        for _ in range(world)
    ]
    seen: list[list[int]] = [[] for _ in range(world)]

    def rank(r: int) -> None:
        agreements = StoreAgreements(clients[r], world)
        pending = None
        for values in rounds:  # as the trainer does: start this step's, read the previous one's
            previous, pending = pending, agreements.start(values[r])
            if previous is not None:
                seen[r].append(previous.wait())
        seen[r].append(pending.wait())

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return seen, clients


@pytest.mark.parametrize("world", [4, 48])
def test_every_rank_gets_the_maximum_for_a_constant_number_of_requests(world: int) -> None:
    rng = random.Random(world)
    rounds = [[0] * world, [rng.choice([0, 0, 0, 1, 2]) for _ in range(world)], [0] * world]
    rounds[2][world - 1] = 3  # one rank alone
    rounds.append([7] * world)  # every rank the same value (the divergence guard's step)
    seen, clients = _agree(world, rounds)
    assert seen == [[max(v) for v in rounds]] * world
    # per agreement: two adds and a get; a compare-and-set per non-zero value (two where a larger
    # value lands between); the last arrival a check, a get and a set; the last reader four
    # deletes and a set -- one rank may be both, whichever the threads' timing makes last; never
    # a number that grows with N
    for r, client in enumerate(clients):
        nonzero = sum(1 for v in rounds if v[r])
        assert client.requests <= len(rounds) * (3 + 3 + 5) + 2 * nonzero, (r, client.requests)
    assert sum(c.requests for c in clients) <= len(rounds) * (3 * world + 3 + 5) + 2 * sum(
        1 for v in rounds for x in v if x
    )


@pytest.mark.parametrize("world", [8, 1024, 4096])
def test_the_heartbeats_reaching_the_store_do_not_grow_with_the_world(world: int) -> None:
    """Each rank writes a heartbeat every `interval` s into the store one host serves: the writes
    it serves per second stay bounded at 1,024 and 4,096 ranks, each rank still beating at least
    once every 10 s (a silent one is named after three missed beats)."""
    from nanolight.parallel.health import STORE_BEATS_PER_S, Heartbeat

    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    beat = Heartbeat("127.0.0.1", server.port, rank=0, world_size=world)
    try:
        assert world / beat.interval <= STORE_BEATS_PER_S  # writes a second the store's host serves
        assert 1.0 <= beat.interval <= 10
    finally:
        beat.close()
