"""Is every rank still there? Heartbeats in the rendezvous store, and errors that say who stopped.

A rank that is stopped (SIGSTOP, a debugger, swapping) or hung (a GPU fault) leaves its peers
blocked in the next collective until the process-group timeout, after which gloo/NCCL report
"Timed out waiting 60000ms for recv operation" -- naming neither the operation nor the rank.
Every rank therefore writes a heartbeat (``time.time()``) into the rendezvous store every
`interval` seconds (1 s, longer in worlds over `STORE_BEATS_PER_S` ranks, so the store's host
serves a bounded number of writes whatever the world) from a daemon thread with its own store connection; when a collective fails,
`PeerError.of` reads the heartbeats and names the ranks that fell silent. A stopped process's
heartbeat thread stops with it, which is what makes the silent rank identifiable.

A stopped rank is told from a dead one, and both from one that failed with its own error: each rank
also leaves its host and pid in the store (a dead local process is seen at once, without waiting
for its heartbeat to age), and a rank ending on an error leaves that error there (`publish_error`)
before it exits. The peer whose collective then fails names that rank and its cause first, not
the failed collective: the real cause is the first line the user reads, whichever rank has it.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from nanolight.errors import NanolightError

KEY = "nanolight/heartbeat/{}"
PID_KEY = "nanolight/pid/{}"  # "host pid" of each rank
ERROR_KEY = "nanolight/error/{}"  # the error a rank ended on (`publish_error`)
STORE_BEATS_PER_S = 500  # the heartbeat writes the store's host serves per second at most, whatever the world
STORE_TIMEOUT_S = 2.0  # the longest the beating thread may spend in one store call (see `_beat`)
F = TypeVar("F", bound=Callable[..., Any])
_SIGNS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "peer", "aborted")


class PeerError(NanolightError, RuntimeError):
    """A collective failed because another rank stopped answering (or died)."""

    @classmethod
    def of(cls, exc: BaseException, what: str, heartbeat: Heartbeat | None) -> PeerError:
        me = dist.get_rank() if dist.is_initialized() else 0
        first = str(exc).splitlines()[0][:200]
        cause = heartbeat.peer_cause() if heartbeat is not None else None
        if cause is not None:  # the real cause first; this rank's failure is only its consequence
            return cls(f"{cause} (rank {me}: {what} then failed waiting for it)")
        who = heartbeat.silent_ranks() if heartbeat is not None else "unknown (no heartbeat)"
        trace = heartbeat.trace_note() if heartbeat is not None else ""
        return cls(
            f"rank {me}: {what} failed waiting for its peers ({first}); "
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
        interval: float | None = None,
        trace: str | None = None,
    ) -> None:
        # one beat a second, but never more than STORE_BEATS_PER_S writes a second reach the store's
        # host: each rank beats less often in a large world (a silent rank is named after 3 beats)
        interval = interval if interval is not None else max(1.0, world_size / STORE_BEATS_PER_S)
        self.host, self.port, self.rank, self.world_size, self.interval = (
            host,
            port,
            rank,
            world_size,
            interval,
        )
        self.trace = trace  # NCCL's flight-recorder dump files: this prefix + the rank (None: no dump)
        self._stop = threading.Event()
        global _active
        _active = self
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
        store, known = None, False
        while not self._stop.is_set():
            try:
                store = store or self._store(timeout=STORE_TIMEOUT_S)
                if not known:  # once: where this rank's process is, for `peer_cause`
                    store.set(PID_KEY.format(self.rank), f"{socket.gethostname()} {os.getpid()}")
                    known = True
                store.set(KEY.format(self.rank), repr(time.time()))
            except Exception:  # the store is slow, stopped or gone: try again at the next beat
                store = None
            self._stop.wait(self.interval)

    def peer_cause(self, wait_s: float = 1.0) -> str | None:
        """The first thing wrong with another rank, in words, if known: the error it ended on
        (`publish_error`), else its process being dead (a local one; `wait_s` lets a process that
        closed its connections finish exiting). None: no peer error or death seen."""
        try:
            store = self._store(timeout=3)
            others = [r for r in range(self.world_size) if r != self.rank]
            errors = [
                store.get(ERROR_KEY.format(r)).decode() for r in others if store.check([ERROR_KEY.format(r)])
            ]
            if errors:
                return min(errors).split(" ", 1)[1]  # the earliest ("<time> <message>")
            where = {
                r: store.get(PID_KEY.format(r)).decode().split()
                for r in others
                if store.check([PID_KEY.format(r)])
            }
        except Exception:
            return None
        local = {r: int(pid) for r, (host, pid) in where.items() if host == socket.gethostname()}
        deadline = time.monotonic() + wait_s
        while True:
            dead = [r for r, pid in sorted(local.items()) if not _alive(pid)]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if not dead:
            return None
        return "; ".join(
            f"rank {r} (pid {local[r]}) died: its process ended without an error of its own (killed, e.g. "
            "by SIGKILL or the out-of-memory killer, or crashed; see the launcher's line for its exit)"
            for r in dead
        )

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
        global _active
        if _active is self:
            _active = None
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * STORE_TIMEOUT_S + 1)  # a connect and a set at most: it ends


_active: Heartbeat | None = None  # this process's heartbeat: its store is where errors are left


def _alive(pid: int) -> bool:
    """Whether process `pid` (on this host) still runs: absent or a zombie is dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def publish_error(message: str) -> None:
    """Leave the error this rank is ending on in the rendezvous store, before it exits: the peer
    whose collective fails when it goes reads it (`Heartbeat.peer_cause`) and prints it first."""
    beat = _active
    if beat is None or beat.world_size < 2:
        return
    if not message.startswith(f"rank {beat.rank}"):
        message = f"rank {beat.rank}: {message}"
    try:
        beat._store(timeout=STORE_TIMEOUT_S).set(ERROR_KEY.format(beat.rank), f"{time.time():.6f} {message}")
    except Exception:  # the store is gone (rank 0 exited): the peers learn nothing more from it
        pass


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
