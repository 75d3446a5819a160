"""`NanoDataModule`: Lightning's DataModule -- the data of a run in one object, apart from the model.

``prepare_data`` runs once per node (local rank 0; the others wait), ``setup(stage)`` on every
process at the start of each trainer call, then the trainer asks for the loader it needs.
``state_dict`` is saved in checkpoints (under the class's qualified name, as Lightning) and
``load_state_dict`` runs whenever a checkpoint is restored. The batch-transfer hooks, when
overridden here, take precedence over the module's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanolight.module.hooks import DataHooks
from nanolight.module.hparams import HyperparametersMixin

if TYPE_CHECKING:
    from nanolight.trainer import NanoTrainer


class NanoDataModule(HyperparametersMixin, DataHooks):
    """Override `setup` and the ``*_dataloader`` methods you use."""

    def __init__(self) -> None:
        self.trainer: NanoTrainer | None = None

    def state_dict(self) -> dict[str, Any]:
        """What to save in checkpoints (plain values / tensors)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | Path, **kwargs: Any) -> NanoDataModule:
        """``cls(**saved hparams, **kwargs)``, then its saved state."""
        from nanolight.checkpoint.reader import CheckpointReader

        state = CheckpointReader.open(checkpoint_path).trainer_state()
        saved = state.get("datamodule_hyper_parameters") or {}
        dm = cls(**{**saved, **kwargs})
        if type(dm).__qualname__ in state.get("datamodule", {}):
            dm.load_state_dict(state["datamodule"][type(dm).__qualname__])
        return dm
