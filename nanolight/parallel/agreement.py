"""Host-side agreements every rank makes each step, at a per-rank cost that does not grow with the world.

Why: a question every rank must answer alike every step (pre-emption: "did a signal reach any rank,
and which?"; the divergence guard's first bad step) is the maximum of one integer over the world.
On the device, reading it would sync the host with every queued kernel; as a gloo all-reduce over
the world it is a ring of 2(N-1) messages per rank per step (0.05-0.4 s at 1-4k ranks) and a full
mesh of connections at creation. The rendezvous store cannot carry it: torchrun's agent hosts that
one, and workers whose agent was killed must still agree to save (`tests/test_faults_distributed.py`).

How: a key-value store that the workers own -- a `TCPStore` server inside global rank 0, its
address handed to the others once over the host group (`ParallelContext.agree_max`). Agreement k
(the k-th the ranks start; they start them in the same order) costs each rank one ``add`` when it
starts and one ``get`` when it reads, plus a compare-and-set only where its value is not zero
(signals are rare), and one ``add`` after it has read: O(1) requests per rank per step, whatever
the world. The rank whose ``add`` completes the count is the last to arrive: every rank's value is
in by then (each raises the maximum before it adds, on the same connection, which the server
answers in order), so it publishes the maximum; the others' ``get`` waits for it (typically read a
step later, by when it has long arrived). The last reader deletes the agreement's keys and says
so; rank 0, whose process holds the server, waits for that before it goes on, so no rank's read can
meet a server that has gone with rank 0's process (its end comes right after its last read). All
ranks read at the same point of the same step, so this waits only for the slowest to get there,
which the step's collectives wait for anyway.

No device value is read: the store answers on the host.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

PREFIX = "nanolight/agree"


def agreed(value: int) -> torch.futures.Future:
    """An agreement already complete (one process: nothing to exchange): a done torch `Future`."""
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(value)
    return done


class StoreAgreements:
    """Agreements on the maximum of one non-negative integer over `world_size` ranks, through
    `store` (one client connection per rank; see the module docstring)."""

    def __init__(self, store: Any, world_size: int, hosts: bool = False) -> None:
        self.store, self.world_size, self.hosts = store, world_size, hosts  # hosts: the server is ours
        self.started = 0  # agreements started by this rank: every rank numbers them alike

    @classmethod
    def hosted(
        cls, rank: int, world_size: int, share: Callable[[Any], Any], timeout: timedelta
    ) -> StoreAgreements:
        """Rank 0 starts the server (a free port); `share` hands its address from rank 0 to every
        rank (a broadcast: collective, once); every other rank connects to it."""
        server = None
        if rank == 0:
            server = dist.TCPStore(
                socket.gethostname(), 0, is_master=True, timeout=timeout, wait_for_workers=False
            )
        host, port = share((socket.gethostname(), server.port) if server is not None else None)
        store = server or dist.TCPStore(host, port, is_master=False, timeout=timeout)
        return cls(store, world_size, hosts=server is not None)

    def start(self, value: int, guard: Callable[[], AbstractContextManager] = nullcontext) -> PendingStoreMax:
        if value < 0:
            raise ValueError(f"an agreement's value must be >= 0, got {value}")
        k, self.started = self.started, self.started + 1
        key = f"{PREFIX}/{k}"
        with guard():
            if value:
                self._raise_to(f"{key}/max", value)
            # this rank arrives; the one whose arrival completes the count publishes the maximum
            if self.store.add(f"{key}/n", 1) == self.world_size:
                top = self.store.get(f"{key}/max") if self.store.check([f"{key}/max"]) else b"0"
                self.store.set(f"{key}/agreed", top)
        return PendingStoreMax(self.store, key, self.world_size, guard, self.hosts)

    def _raise_to(self, key: str, value: int) -> None:
        """The store's value at `key` becomes at least `value` (a compare-and-set loop: only ranks
        with a larger value than the one stored write)."""
        expected = ""
        while True:
            now = self.store.compare_set(key, expected, str(value))
            if int(now) >= value:
                return
            expected = now.decode()


class PendingStoreMax:
    """Agreement `key`'s maximum, read from the store at `wait` (a ``get``: waits only if the last
    rank has not arrived yet); the last of the `world_size` readers deletes the agreement's keys;
    the rank that `hosts` the server waits until then."""

    def __init__(
        self,
        store: Any,
        key: str,
        world_size: int,
        guard: Callable[[], AbstractContextManager],
        hosts: bool = False,
    ) -> None:
        self.store, self.key, self.world_size, self.guard, self.hosts = store, key, world_size, guard, hosts
        self.value: int | None = None

    def wait(self) -> int:
        """The agreed value (the same on every rank)."""
        if self.value is None:
            with self.guard():
                self.value = int(self.store.get(f"{self.key}/agreed"))
                # this rank has read it; the last reader removes the agreement from the store
                if self.store.add(f"{self.key}/read", 1) == self.world_size:
                    for name in ("n", "max", "agreed", "read"):
                        self.store.delete_key(f"{self.key}/{name}")
                    self.store.set(f"{self.key}/done", b"1")
                if self.hosts:  # the server lives in this process: every rank has read before it goes on
                    self.store.wait([f"{self.key}/done"])
                    self.store.delete_key(f"{self.key}/done")
        return self.value
