"""Pre-emption: on SIGTERM or SIGUSR1, finish the current optimizer step, save, and stop cleanly.

Why: clusters announce the end of a job with a signal some seconds before they kill it (SLURM
``--signal=USR1@90``, Kubernetes and spot/pre-emptible VMs send SIGTERM and wait a grace period).
Python's default action for both signals ends the process at once, losing every step since the
last periodic checkpoint. Instead the handler only records the signal; the trainer looks at it
at the end of each optimizer step, a safe point (the update is applied, no collective is in
flight), and the ranks agree through `Strategy.any_rank`, so a signal that reached only one rank
(``kill`` of one pid, a scheduler signalling one task) still stops every rank at the same step: a
rank that stopped alone would leave its peers blocked in their next collective. Then every rank
takes part in one checkpoint save, the fit returns normally and the script exits 0; the next
launch with ``ckpt_path="last"`` (recipe: ``checkpoint.resume=last``) continues exactly.

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


class Preemption:
    """Context manager around ``fit``: records SIGTERM/SIGUSR1 instead of dying of them."""

    def __init__(self, trainer: NanoTrainer) -> None:
        self.trainer = trainer
        self.received: str | None = None  # name of the first signal this process got
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        self.received = self.trainer.preempted_by = None
        if threading.current_thread() is threading.main_thread():
            for name in SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _record(self, signum: int, frame: object) -> None:
        self.received = self.received or signal.Signals(signum).name

    def check(self) -> None:
        """End of an optimizer step, on every rank: if any rank got a signal, save and stop."""
        trainer = self.trainer
        strategy = trainer.strategy
        if not strategy.any_rank(self.received is not None):  # no collective on one process
            return
        # which signal, agreed so `preempted_by` is the same on every rank (once per run)
        trainer.preempted_by = "SIGTERM" if strategy.any_rank(self.received == "SIGTERM") else "SIGUSR1"
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
