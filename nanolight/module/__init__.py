"""What users subclass: `NanoModule` (`module.py`, its hooks in `hooks.py`) and `NanoDataModule`
(`datamodule.py`); ``self.hparams`` (`hparams.py`), ``self.optimizers()`` (`nano_optimizer.py`),
the forms `configure_optimizers` may return (`optimizers.py`) and `load_from_checkpoint`
(`loading.py`)."""

from nanolight.module.datamodule import NanoDataModule
from nanolight.module.module import NanoModule

__all__ = ["NanoDataModule", "NanoModule"]
