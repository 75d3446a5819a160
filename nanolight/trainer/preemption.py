"""Pre-emption: SIGTERM/SIGUSR1 (and, for the recipe, Ctrl-C) -> finish the step, save, and stop at
a step every rank agrees on (`Preemption`, checked by the fit loop at each step's end)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanolight.parallel.environment import STOP_REASON_VAR

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer


# Why: clusters announce the end of a job with a signal some seconds before they kill it (SLURM
# ``--signal=USR1@90``, Kubernetes and spot/pre-emptible VMs send SIGTERM and wait a grace period).
# Python's default action for both ends the process at once, losing every step since the last
# periodic checkpoint. Instead the handler only records the signal; the trainer looks at it at the
# end of each optimizer step, a safe point (the update is applied, no collective is in flight).
# With several ranks they must agree, so a signal that reached only one rank (``kill`` of one pid,
# a scheduler signalling one task) still stops every rank at the same step: a rank that stopped
# alone would leave its peers blocked in their next collective. Then every rank takes part in one
# checkpoint save, the fit returns normally and the script exits 0; the next launch with
# ``ckpt_path="last"`` (recipe: ``checkpoint.resume=last``) continues exactly.
#
# The agreement must not cost a device sync every step: it is one host-side maximum of one integer
# (0 nothing, 1 SIGUSR1, 2 SIGTERM), through a store rank 0 hosts (`parallel/agreement.py`: O(1)
# requests per rank, whatever the world; no torchrun agent needed) started at the end
# of step k without waiting (`Strategy.agree_max`) and read at the end of step k+1, when it has
# long arrived. So with several ranks the run stops (and saves) one step after the signal's step;
# one process exchanges nothing and stops at the signal's step. When the fit loop ends, the
# request still in flight is waited for (`finish`): no collective is left behind.
#
# Handlers are installed only from the main thread (Python allows no other) and only for the
# duration of ``fit``; the previous handlers are restored afterwards.


SIGNALS = ("SIGTERM", "SIGUSR1")  # SIGUSR1: SLURM's usual `--signal=USR1@<seconds>`; absent on Windows
CODES = {None: 0, "SIGUSR1": 1, "SIGTERM": 2, "SIGINT": 3}  # what a rank sends; the maximum wins
NAMES = {code: name for name, code in CODES.items() if name}


class Preemption:
    """Context manager around ``fit``: records SIGTERM/SIGUSR1 instead of dying of them.

    Ctrl-C (SIGINT) keeps Lightning's meaning (``KeyboardInterrupt``: ``on_exception``, nothing
    saved) unless `save_on_interrupt` is set (the recipe sets it: "nothing lost"): then it is a
    pre-emption too, and a second one stops the process at once, unsaved, with status 130.
    `save_on_signal=False` leaves SIGTERM/SIGUSR1 their default meaning too, for a run with nothing
    to save (the dry run: its tensors are fake, and it writes nothing)."""

    def __init__(self, trainer: NanoTrainer) -> None:
        self.trainer = trainer
        self.save_on_interrupt = False
        self.save_on_signal = True
        self.received: str | None = None  # name of the first signal this process got
        self._previous: dict[int, Any] = {}
        self._pending: Any = None  # the agreement started at the last check, read at the next

    def __enter__(self) -> Preemption:
        self.received = self.trainer.preempted_by = None
        self._pending = None
        if threading.current_thread() is threading.main_thread():
            names = SIGNALS if self.save_on_signal else ()
            for name in names + (("SIGINT",) if self.save_on_interrupt else ()):
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
        if signum == signal.SIGINT and self.received == "SIGINT":  # Ctrl-C twice: the user will not wait
            print("nanolight: Ctrl-C again: stopped at once, nothing saved", file=sys.stderr, flush=True)
            os._exit(130)  # what a shell reports for SIGINT; the checkpoints saved so far are complete
        self.received = self.received or signal.Signals(signum).name

    def check(self) -> None:
        """End of an optimizer step, on every rank: if the ranks agreed that one got a signal,
        save and stop (see above for which step)."""
        code = CODES[self.received]
        if self.trainer.strategy.world_size == 1:
            self._stop(code)  # one process: nothing to agree on, no collective
            return
        agreed = self._read()  # started at the previous step
        if not agreed:
            # every rank sends its signal code, the world's maximum is read at the next check
            self._pending = self.trainer.strategy.agree_max(code)
        self._stop(agreed)

    def finish(self) -> None:
        """The fit loop ended: wait for the agreement in flight (every rank started it at the
        same last step); a signal it carries is acted on as at a step's end."""
        self._stop(self._read())

    def _read(self) -> int:
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else 0

    def _stop(self, agreed: int) -> None:
        """Save and stop when `agreed` names a signal (0: none)."""
        if not agreed:
            return
        trainer = self.trainer
        trainer.preempted_by = NAMES[agreed]  # agreed, so the same on every rank (once per run)
        # through the first ModelCheckpoint, so `last` and its pruning stay consistent (a no-op if
        # it saved this step already); without one, to <root>/checkpoints/step-N
        cb = trainer.checkpoint_callback
        path = Path(trainer.default_root_dir) / "checkpoints" / f"step-{trainer.global_step}"
        if cb is not None:
            path = Path(cb.save_now(trainer))
        else:
            trainer.save_checkpoint(path)
        trainer.should_stop = True
        hint = (
            "ckpt_path='last' / checkpoint.resume=last"
            if cb is None or cb.save_last
            else f"ckpt_path='{path}'"
        )
        if trainer.is_global_zero:
            # a SIGTERM a rank sent itself (`watch_launcher`) says why, not that one was received
            why = os.environ.get(STOP_REASON_VAR) if agreed == CODES["SIGTERM"] else None
            print(
                f"nanolight: {why or trainer.preempted_by + ' received'}: finished step {trainer.global_step}, "
                f"saved {path}; stopping (continue with {hint})",
                file=sys.stderr,
                flush=True,
            )
