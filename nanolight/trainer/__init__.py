"""The trainer: `NanoTrainer` (`trainer.py`) and the parts it holds -- hooks, data, metrics,
optimization, the fit loop (`loops.py`, one step in `step.py`), evaluation, the trainer's part of
a checkpoint (`state.py`) and preemption (`preemption.py`)."""

from nanolight.trainer.trainer import NanoTrainer

__all__ = ["NanoTrainer"]
