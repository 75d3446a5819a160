"""What users subclass: `NanoModule` and `NanoDataModule` (`module.py`, their hooks in
`hooks.py`); ``self.hparams`` (`hparams.py`), ``self.optimizers()`` and the forms
`configure_optimizers` may return (`optimizers.py`) and `load_from_checkpoint` (`loading.py`)."""

from nanolight.module.module import NanoDataModule, NanoModule

__all__ = ["NanoDataModule", "NanoModule"]
