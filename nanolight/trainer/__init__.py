"""The trainer: `NanoTrainer` (`trainer.py`) and its parts -- the fit and validation loops
(`loops.py`), one optimizer step (`step.py`), logged metrics (`metrics.py`), the data position
(`data_position.py`), the trainer's part of a checkpoint (`state.py`) and preemption
(`preemption.py`)."""

from nanolight.trainer.trainer import NanoTrainer

__all__ = ["NanoTrainer"]
