"""Pre-emption: on SIGTERM or SIGUSR1, finish the optimizer step, save, and stop cleanly.

Why: clusters announce the end of a job with a signal some seconds before they kill it (SLURM
``--signal=USR1@90``, Kubernetes and spot/pre-emptible VMs send SIGTERM and wait a grace period).
Python's default action for both signals ends the process at once, losing every step since the
last periodic checkpoint. Instead the handler only records the signal; the trainer looks at it
at the end of each optimizer step, a safe point (the update is applied, no collective is in
flight). With several ranks they must agree, so a signal that reached only one rank (``kill`` of
one pid, a scheduler signalling one task) still stops every rank at the same step: a rank that
stopped alone would leave its peers blocked in their next collective. Then every rank takes part
in one checkpoint save, the fit returns normally and the script exits 0; the next launch with
``ckpt_path="last"`` (recipe: ``checkpoint.resume=last``) continues exactly.

The agreement must not cost a device sync every step, so it is one host-side maximum of one
integer per step, a host-side all-reduce over gloo (`parallel/context.py`) -- 0 nothing, 1 SIGUSR1, 2 SIGTERM, the maximum wins -- started at the end of
step k without waiting (`Strategy.start_max`) and read at the end of step k+1, when it has long
arrived. Every rank reads the same value at the same step, so with several ranks the
run stops (and saves) one step after the signal's step; one process exchanges nothing and stops
at the signal's step. When the fit loop ends, the request still in flight is waited for
(`finish`): no collective is left behind, and a signal it carries still gets its save.

Handlers are installed only from the main thread (Python allows no other) and only for the
duration of ``fit``; the previous handlers are restored afterwards, so the process handles
signals after ``fit`` as it did before.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer

SIGNALS = ("SIGTERM", "SIGUSR1")  # SIGUSR1: SLURM's usual `--signal=USR1@<seconds>`; absent on Windows
CODES = {None: 0, "SIGUSR1": 1, "SIGTERM": 2}  # what a rank sends; the maximum wins (SIGTERM)
NAMES = {code: name for name, code in CODES.items() if name}


class Preemption:
    """Context manager around ``fit``: records SIGTERM/SIGUSR1 instead of dying of them."""

    def __init__(self, trainer: NanoTrainer) -> None:
        self.trainer = trainer
        self.received: str | None = None  # name of the first signal this process got
        self._previous: dict[int, Any] = {}
        self._pending: Any = None  # the agreement started at the last check, read at the next

    def __enter__(self) -> Preemption:
        self.received = self.trainer.preempted_by = None
        self._pending = None
        if threading.current_thread() is threading.main_thread():
            for name in SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        self._pending = None  # after an error a peer may be gone: never wait for it here
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _record(self, signum: int, frame: object) -> None:
        self.received = self.received or signal.Signals(signum).name

    def check(self) -> None:
        """End of an optimizer step, on every rank: if the ranks agreed that one got a signal,
        save and stop (see the module docstring for which step)."""
        code = CODES[self.received]
        if self.trainer.strategy.world_size == 1:
            agreed = code  # one process: nothing to agree on, no collective
        else:
            pending, self._pending = self._pending, None
            agreed = pending.wait() if pending is not None else 0  # started at the previous step
            if not agreed:
                # every rank sends its signal code, the world's maximum is read at the next check
                self._pending = self.trainer.strategy.start_max(code)
        if agreed:
            self._stop(NAMES[agreed])

    def finish(self) -> None:
        """The fit loop ended: wait for the agreement in flight (every rank started it at the
        same last step); a signal it carries is acted on as at a step's end."""
        pending, self._pending = self._pending, None
        agreed = pending.wait() if pending is not None else 0
        if agreed:
            self._stop(NAMES[agreed])

    def _stop(self, name: str) -> None:
        trainer = self.trainer
        trainer.preempted_by = name  # agreed, so the same on every rank (once per run)
        path = save_now(trainer)
        trainer.should_stop = True
        cbs = trainer.checkpoint_callbacks
        hint = (
            "ckpt_path='last' / checkpoint.resume=last"
            if not cbs or cbs[0].save_last
            else f"ckpt_path='{path}'"
        )
        if trainer.is_global_zero:
            print(
                f"nanolight: {trainer.preempted_by} received: finished step {trainer.global_step}, "
                f"saved {path}; stopping (continue with {hint})",
                file=sys.stderr,
                flush=True,
            )


def save_now(trainer: NanoTrainer) -> Path:
    """Save the current step through the first `ModelCheckpoint` (so ``last`` and its pruning stay
    consistent; a no-op if it already saved this step), else to ``<root>/checkpoints/step-N``."""
    callbacks = trainer.checkpoint_callbacks
    if callbacks:
        return Path(callbacks[0].save_now(trainer))
    path = Path(trainer.default_root_dir) / "checkpoints" / f"step-{trainer.global_step}"
    trainer.save_checkpoint(path)
    return path
