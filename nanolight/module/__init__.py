"""`NanoModule`, the user's base class (`module.py`), and the forms `configure_optimizers` may
return (`optimizers.py`)."""

from nanolight.module.module import NanoModule

__all__ = ["NanoModule"]
