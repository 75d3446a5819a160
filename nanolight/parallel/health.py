"""Is every rank still there? Heartbeats in the rendezvous store, and errors that say who stopped.

A rank that is stopped (SIGSTOP, a debugger, swapping) or hung (a GPU fault) leaves its peers
blocked in the next collective until the process-group timeout, after which gloo/NCCL report
"Timed out waiting 60000ms for recv operation" -- naming neither the operation nor the rank.
Every rank therefore writes a heartbeat (``time.time()``) into the rendezvous store every
`interval` seconds from a daemon thread with its own store connection; when a collective fails,
`PeerError.of` reads the heartbeats and names the ranks that fell silent. A stopped process's
heartbeat thread stops with it, which is what makes the silent rank identifiable.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from nanolight.errors import NanolightError

KEY = "nanolight/heartbeat/{}"
STORE_TIMEOUT_S = 2.0  # the longest the beating thread may spend in one store call (see `_beat`)
F = TypeVar("F", bound=Callable[..., Any])
_SIGNS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "peer", "aborted")


class PeerError(NanolightError, RuntimeError):
    """A collective failed because another rank stopped answering (or died)."""

    @classmethod
    def of(cls, exc: BaseException, what: str, heartbeat: Heartbeat | None) -> PeerError:
        me = dist.get_rank() if dist.is_initialized() else 0
        who = heartbeat.silent_ranks() if heartbeat is not None else "unknown (no heartbeat)"
        trace = heartbeat.trace_note() if heartbeat is not None else ""
        return cls(
            f"rank {me}: {what} failed waiting for its peers ({str(exc).splitlines()[0][:200]}); "
            f"{who}.{trace} The job is ending: a stopped, hung or dead rank cannot be waited for"
        )


class Heartbeat:
    """This rank's heartbeat, and the others', through the rendezvous store at `host`:`port`."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        interval: float = 1.0,
        trace: str | None = None,
    ) -> None:
        self.host, self.port, self.rank, self.world_size, self.interval = (
            host,
            port,
            rank,
            world_size,
            interval,
        )
        self.trace = trace  # NCCL's flight-recorder dump files: this prefix + the rank (None: no dump)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="nanolight-heartbeat", daemon=True)
        self._thread.start()

    def _store(self, timeout: float) -> Any:
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=timeout))

    def _beat(self) -> None:
        """Every call into the store is bounded by `STORE_TIMEOUT_S`, so `close` always joins this
        thread: a daemon thread still inside a C++ call when the interpreter finalizes is ended by
        a forced unwind through pybind11's noexcept GIL guard -- "terminate called without an
        active exception", exit 134 -- e.g. waiting 30 s on a store whose host (rank 0) is
        stopped or has just exited."""
        store = None
        while not self._stop.is_set():
            try:
                store = store or self._store(timeout=STORE_TIMEOUT_S)
                store.set(KEY.format(self.rank), repr(time.time()))
            except Exception:  # the store is slow, stopped or gone: try again at the next beat
                store = None
            self._stop.wait(self.interval)

    def silent_ranks(self) -> str:
        """Which ranks stopped beating, in words (asked after a collective failed)."""
        try:
            store, now = self._store(timeout=3), time.time()
            ages = {
                r: now - float(store.get(KEY.format(r))) for r in range(self.world_size) if r != self.rank
            }
        except Exception:
            return (
                f"the rendezvous store at {self.host}:{self.port} does not answer either (rank 0 hosts it "
                "unless torchrun's agent does: it may be the stopped one)"
            )
        silent = sorted(r for r, age in ages.items() if age > 3 * self.interval + 2)
        if not silent:
            return "every other rank is still alive (the failure is in the communication itself)"
        return ", ".join(f"rank {r} stopped answering (no heartbeat for {ages[r]:.0f} s)" for r in silent)

    def trace_note(self) -> str:
        """Where NCCL's flight recorder wrote each rank's last collectives (on a timeout), in words."""
        if self.trace is None:
            return ""
        return (
            f" NCCL's flight recorder dumps each rank's last collectives to {self.trace}<rank> (this rank: "
            f"{self.trace}{self.rank}; read them with torch's flight-recorder analyzer, torchfrtrace)."
        )

    def close(self) -> None:
        """Stop beating and wait for the thread, so its store connection is closed before the
        process groups (and rank 0's store) are torn down at exit."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * STORE_TIMEOUT_S + 1)  # a connect and a set at most: it ends


def watched(what: str) -> Callable[[F], F]:
    """A method of an object with a ``heartbeat`` attribute, run under `watch`."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            with watch(what, self.heartbeat):
                return fn(self, *args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


@contextmanager
def watch(what: str, heartbeat: Heartbeat | None) -> Iterator[None]:
    """Around collectives: a peer failure becomes a `PeerError` naming `what` and the silent ranks."""
    try:
        yield
    except NanolightError:
        raise
    except RuntimeError as exc:
        if not any(sign in str(exc).lower() for sign in _SIGNS):
            raise
        raise PeerError.of(exc, what, heartbeat) from exc
