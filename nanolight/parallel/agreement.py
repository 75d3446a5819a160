"""Host-side agreements over every rank -- a small integer's maximum, a picklable object from one
rank -- through the rendezvous store, at a per-rank cost that does not grow with the world.

Why not a collective: a question every rank must answer alike every step (pre-emption: "did a
signal reach any rank, and which?") done on the device under NCCL makes the host wait for every
queued kernel when the answer is read. On the host, a gloo group over the whole world costs each
rank N-1 sockets (gloo connects every pair when the group is made: seconds of set-up at scale) and
a ring all-reduce of 2(N-1) hops per question. The rendezvous store (the TCPStore every rank
joined at start-up, through the connection it already holds) answers with a constant number of
small messages per rank, whatever N: for a maximum,

    start   add(count, 1)  [+ compare_set(max) when this rank's value is > 0 -- rare]
            the rank that brings the count to N sets `done`
    wait    wait(done) -- long set when read one step later -- and get(max); add(read, 1), and
            rank 0 (the store's host) waits until every rank has read, then deletes the round's keys

i.e. per rank 1 connection and 4 messages per agreement (the last arriver/reader 1-3 more); the
store's host serves O(N) small requests per agreement, as it does for the heartbeats. Every rank
runs the same agreements in the same order (they are collective), so a round number names each.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch.distributed as dist

PREFIX = "nanolight/agree/"


class Agreed:
    """An agreement already complete (one process: nothing to exchange)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def wait(self) -> int:
        return self.value


class StoreAgreements:
    """This rank's end of the world's host-side agreements, over `store` (the rendezvous store).
    `guard` wraps each store exchange (e.g. a heartbeat watch that names a silent peer)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        # A second context over the same world (or a re-created one) must not meet the first one's
        # keys: each rank adds 1 once per context, in step (contexts are made collectively), so
        # ceil(count / N) numbers this context alike on every rank.
        generation = -(-dist.PrefixStore(PREFIX, store).add("contexts", 1) // world_size)
        self.store = dist.PrefixStore(f"{PREFIX}{generation}/", store)
        self.round = 0  # the same on every rank: agreements are started in the same order

    def _next(self) -> str:
        self.round += 1
        return str(self.round)

    def start_max(self, value: int, guard: Callable[[], AbstractContextManager] = nullcontext) -> PendingMax:
        """Start agreeing on the maximum of every rank's `value` (an int >= 0); `.wait()` gives it."""
        if value < 0:
            raise ValueError(f"an agreed maximum is of ints >= 0, got {value}")
        return PendingMax(self, self._next(), value, guard)

    def broadcast(self, obj: Any, src: int, guard: Callable[[], AbstractContextManager] = nullcontext) -> Any:
        """`obj` as rank `src` holds it, on every rank (pickled through the store)."""
        key = self._next()
        with guard():
            if self.rank == src:  # rank `src` posts the object; every other rank fetches it
                self.store.set(f"{key}/obj", pickle.dumps(obj))
            else:
                self.store.wait([f"{key}/obj"], self.timeout)
                obj = pickle.loads(self.store.get(f"{key}/obj"))
            self.done_reading(key, ("obj", "read"))
        return obj

    def done_reading(self, key: str, names: tuple[str, ...]) -> None:
        """This rank has read the round. Rank 0 -- the store's host under `tcp://` / `env://`
        rendezvous -- returns only once every rank has: a rank still reading after the host's
        process ended would find no store (connection reset). It then deletes the round's keys, so
        the store does not grow with the steps."""
        reads = self.store.add(f"{key}/read", 1)
        if self.rank != 0:
            if reads == self.world_size:  # the last reader tells rank 0
                self.store.set(f"{key}/all_read", "1")
            return
        if reads < self.world_size:  # another rank reads last: wait for its word
            self.store.wait([f"{key}/all_read"], self.timeout)
        for name in (*names, "all_read"):
            self.store.delete_key(f"{key}/{name}")


class PendingMax:
    """The maximum of each rank's `value` for one round, started at construction and read by
    `wait` (typically one step later, by when every rank has long started it)."""

    def __init__(
        self, agreements: StoreAgreements, key: str, value: int, guard: Callable[[], AbstractContextManager]
    ) -> None:
        self.agreements, self.key, self.guard = agreements, key, guard
        store = agreements.store
        with guard():
            if value > 0:  # raise the round's maximum to `value` (the store compares and swaps)
                current = store.compare_set(f"{key}/max", "", str(value)).decode()
                while int(current) < value:
                    current = store.compare_set(f"{key}/max", current, str(value)).decode()
            # the value is in before the count says so: whoever sees N sees every value
            if store.add(f"{key}/count", 1) == agreements.world_size:
                store.set(f"{key}/done", "1")
        self.value: int | None = None

    def wait(self) -> int:
        """The agreed value (the same on every rank); waits only if some rank has not started it."""
        if self.value is None:
            agreements, key = self.agreements, self.key
            store = agreements.store
            with self.guard():
                store.wait([f"{key}/done"], agreements.timeout)
                # absent when every rank sent 0: compare_set then writes (and returns) "0"
                self.value = int(store.compare_set(f"{key}/max", "", "0").decode())
                agreements.done_reading(key, ("max", "count", "done", "read"))
        return self.value
